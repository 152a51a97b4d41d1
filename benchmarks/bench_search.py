"""Text search benchmark: ``ls --grep`` against DuckDB searching a decoded export of the same run.

The run is the shipped sample run's step 5 (real span shapes and token ids: agent, model calls,
parser, tool), replicated to ``--per-step`` trajectories a step over ``--steps`` steps, written as
sealed shards (the issue's size: 200 x 1,024). Its decoded export is what ``rlreplay export``
writes (Parquet: one record per trajectory, ``messages`` in the OpenAI chat format); DuckDB
searches the assistant and tool messages' content with ``regexp_matches`` (RE2, as ``--grep``).

Printed side by side, as ratios to DuckDB's query on the ready export:
- rlreplay, first search of the run (decodes every step, keeps the texts in the user's cache);
- rlreplay, a later search (reads the kept texts);
- the export itself (what a user pays once before DuckDB can search the text);
- both as whole commands (``rlreplay ls --grep`` and ``python -c "import duckdb; ..."``).

    python benchmarks/bench_search.py                          # 200 steps x 1,024 trajectories
    python benchmarks/bench_search.py --steps 4 --per-step 256 # a rough figure in a minute
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

import rlreplay
from rlreplay.read.selection import Selection

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import synthetic_run  # noqa: E402  (tests/: the run builder the UI tests share)
from bench_query import build_run  # noqa: E402

SAMPLE_RUN = ROOT / "sample_runs" / "gsm8k-grpo-qwen3"
TEMPLATE_STEP = 5
#: a pattern of the model's answers and the tool's results (numbers with a decimal point)
PATTERN = r"\d+\.\d+"
DUCKDB_QUERY = """
SELECT id FROM read_parquet('{path}')
WHERE len(list_filter(messages,
    lambda m: m.role IN ('assistant', 'tool') AND regexp_matches(m.content, '{rx}'))) > 0
"""


def step_template(per_step: int) -> pa.Table:
    """One training step of spans, payloads and token ids kept, replicated to ``per_step`` trajectories."""
    base = rlreplay.open_run(SAMPLE_RUN).spans(step=TEMPLATE_STEP)
    base = base.filter(pc.invert(pc.fill_null(base["validate"], False)))
    per_copy = len(set(base["trajectory_id"].to_pylist()))
    return synthetic_run.replicate(base, max(1, per_step // per_copy), 10_000)


def make_run(root: Path, steps: int, per_step: int) -> Path:
    run_dir = build_run(root, step_template(per_step), steps)
    manifest = json.loads((SAMPLE_RUN / "run.json").read_text())
    manifest.update(format_version=2, experiment="bench-search", steps=steps)
    (run_dir / "run.json").write_text(json.dumps(manifest))
    return run_dir


def timed(fn: Callable[[], Any], repeats: int = 1) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def command(argv: list[str], repeats: int, env: dict[str, str]) -> float:
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=env)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--per-step", type=int, default=1024)
    parser.add_argument("--pattern", default=PATTERN)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="build the run and its export here and keep them")
    args = parser.parse_args()
    import duckdb

    root = args.keep or Path(tempfile.mkdtemp(prefix="rlreplay-bench-search-"))
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["XDG_CACHE_HOME"] = str(cache)  # a first search decodes: nothing kept from before
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    try:
        start = time.perf_counter()
        run_dir = root / f"run-{args.steps}" if (root / f"run-{args.steps}").exists() else None
        run_dir = run_dir or make_run(root, args.steps, args.per_step)
        run = rlreplay.open_run(run_dir)
        n = run.trajectories().num_rows
        print(f"run: {args.steps} steps, {n:,} trajectories ({time.perf_counter() - start:.1f}s to build)")
        export = root / "export.parquet"
        t_export = 0.0
        if not export.exists():
            t_export = command(
                [sys.executable, "-m", "rlreplay", "export", str(run_dir), "--out", str(export)], 1, env
            )
        query = DUCKDB_QUERY.format(path=export, rx=args.pattern.replace("'", "''"))
        con = duckdb.connect()
        t_duck, found = timed(lambda: con.sql(query).fetchall(), args.repeats)
        theirs = {row[0] for row in found}
        selection = Selection(grep=args.pattern)
        t_first, got = timed(lambda: selection.trajectories(rlreplay.open_run(run_dir)), 1)
        t_later, got = timed(lambda: selection.trajectories(rlreplay.open_run(run_dir)), args.repeats)
        ours = set(got["id"].to_pylist())
        grep = [sys.executable, "-m", "rlreplay", "ls", str(run_dir), "--grep", args.pattern, "--json"]
        duck = [sys.executable, "-c", f"import duckdb; duckdb.sql({query!r}).fetchall()"]
        c_ours, c_duck = command(grep, args.repeats, env), command(duck, args.repeats, env)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    print(
        f"pattern {args.pattern!r}: rlreplay finds {len(ours):,}, DuckDB {len(theirs):,}, "
        f"both {len(ours & theirs):,}"
    )
    print(f"load average {load:.1f}\n")
    print("| what | rlreplay | DuckDB on the decoded export | rlreplay / DuckDB |")
    print("|---|---:|---:|---:|")
    rows = [
        ("search, first (decodes, keeps the texts)", t_first, t_duck),
        ("search, later (the kept texts)", t_later, t_duck),
        ("whole command (`ls --grep` / `python -c duckdb`)", c_ours, c_duck),
    ]
    for label, a, b in rows:
        print(f"| {label} | {a * 1000:,.0f} ms | {b * 1000:,.0f} ms | {a / b:.2f}x |")
    if t_export:
        print(f"| making the export (`rlreplay export`, once) | | {t_export * 1000:,.0f} ms | |")


if __name__ == "__main__":
    main()
