"""Audit benchmark: ``rlreplay audit`` over whole synthetic runs, time and peak memory.

1. Listing checks (``group_collapse``, ``mismatch``) over a 200 x 1,024-trajectory run built as
   ``bench_query.py`` builds its runs (the sample run's step 5 replicated, random rewards and
   trainer-vs-rollout differences), against the same questions written directly in DuckDB over
   the span files.
2. Every check (the trajectory checks stream each trajectory's token ids) over a run recorded with
   the real recorder and ``agent_workload.py``'s agent loop: real Qwen3 ids, 2-5 model calls per
   trajectory, a tool call between them.

Peak memory is the audit process's maximum resident set size.

    python benchmarks/bench_audit.py                                  # 200 x 1,024 and 8 x 256
    python benchmarks/bench_audit.py --steps 20 --record-steps 2      # smaller
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_workload import make_agent_loop
from bench_query import build_run, step_template

ROOT = Path(__file__).resolve().parent.parent

MEASURE = """
import resource, subprocess, sys, time
t = time.perf_counter()
proc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
took = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(took, peak, proc.returncode, proc.stdout.count(b"\\n"))
"""


def measure(args: list[str]) -> tuple[float, float, int]:
    """(seconds, peak MB, lines of output) of ``rlreplay ARGS`` as its own process."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, sys.executable, "-m", "rlreplay", *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.split()
    took, rss_kb, rc, lines = float(out[0]), int(out[1]), int(out[2]), int(out[3])
    assert rc in (0, 1), f"rlreplay {' '.join(args)} exited {rc}"
    return took, rss_kb / 1024, lines


def build_listing_run(root: Path, steps: int, per_step: int) -> Path:
    """bench_query's synthetic run with a signals row per trajectory: the reward (0 or 1) and a
    trainer-vs-rollout difference, three outliers a step."""
    template = step_template(per_step)
    template = template.set_column(
        template.column_names.index("reward"), "reward", pa.nulls(template.num_rows, pa.float64())
    )
    roots = template.filter(pc.equal(template["kind"], "trajectory"))
    diffs = np.random.default_rng(0).gamma(2.0, 0.01, roots.num_rows)
    diffs[:3] = 3.0
    signals = roots
    for name, values in (
        ("kind", pa.array(["signals"] * roots.num_rows)),
        ("span_id", pc.binary_join_element_wise(roots["span_id"], pa.scalar("5"), "")),
        ("parent_id", roots["span_id"]),
        ("reward", pa.array([0.0] * roots.num_rows)),
        ("logprob_diff_max", pa.array(diffs)),
    ):
        signals = signals.set_column(signals.column_names.index(name), name, values)
    template = pa.concat_tables([template, signals.cast(template.schema)])
    run_dir = build_run(root, template, steps, draw=lambda rng, n: rng.integers(0, 2, n).astype(float))
    return run_dir


_PER_TRAJECTORY = """
WITH t AS (
  SELECT trajectory_id AS id, any_value(step) AS step, any_value(sample_index) AS sample_index,
    coalesce(any_value(validate), false) AS validate,
    arg_max(reward, end_ns) FILTER (kind IN ('signals', 'agent', 'trajectory') AND reward IS NOT NULL)
      AS reward,
    max(logprob_diff_max) FILTER (kind = 'signals') AS diff
  FROM read_parquet('{files}', hive_partitioning = false) GROUP BY trajectory_id)
"""
DUCKDB_COLLAPSE = (
    _PER_TRAJECTORY
    + """
SELECT step, sample_index FROM t WHERE NOT validate AND reward IS NOT NULL
GROUP BY step, sample_index HAVING count(*) >= 2 AND max(reward) = min(reward)
"""
)
DUCKDB_MISMATCH = (
    _PER_TRAJECTORY
    + """
, m AS (SELECT step, validate, median(diff) AS med, count(diff) AS n FROM t GROUP BY ALL)
, a AS (SELECT t.step, t.validate, median(abs(diff - med)) AS mad
       FROM t JOIN m USING (step, validate) GROUP BY ALL)
SELECT id FROM t JOIN m USING (step, validate) JOIN a USING (step, validate)
WHERE diff > CASE WHEN n >= 8 THEN least(1.0, greatest(med + 10 * 1.4826 * mad, 0.1)) ELSE 1.0 END
"""
)


def duckdb_time(query: str, run_dir: Path) -> tuple[float, int]:
    import duckdb

    con = duckdb.connect()
    sql = query.format(files=f"{run_dir}/spans/*/*/*.parquet")
    con.execute(sql).fetchall()  # warm the page cache as the audit's warm-up does
    t = time.perf_counter()
    rows = con.execute(sql).fetchall()
    return time.perf_counter() - t, len(rows)


def in_process(run_dir: Path, check: str) -> float:
    """Seconds of the audit itself in this process (the listing read from the run index)."""
    from rlreplay.audit import engine
    from rlreplay.read.open import open_run

    chosen = engine.choose(check, engine.available())
    run = open_run(run_dir)
    t = time.perf_counter()
    engine.audit(run, run.trajectories(), chosen)
    return time.perf_counter() - t


def record_run(root: Path, steps: int, per_step: int) -> Path:
    """A run recorded with the real recorder: agent_workload's loop, 2-5 model calls, ~2k tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_scale import token_pool

    import rlreplay

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import qwen_tokenizer_dir

    run_dir = root / f"recorded-{steps}x{per_step}"
    pool = token_pool(qwen_tokenizer_dir(), 400_000)
    rng, nprng = random.Random(0), np.random.default_rng(0)
    rlreplay.init(run_dir, experiment="bench-audit", worker="w0")
    run_loop = make_agent_loop(rlreplay, pool, rng, nprng)

    async def one(step: int, i: int) -> None:
        async with rlreplay.trajectory(step=step, sample_index=i // 8, rollout_n=i % 8, name="agent_loop"):
            await run_loop(f"{step}-{i}", rng.randrange(1_000, 3_000), rng.randrange(2, 6))

    async def go() -> None:
        for step in range(steps):
            await asyncio.gather(*(one(step, i) for i in range(per_step)))

    asyncio.run(go())
    rlreplay.close()
    from rlreplay.format import manifest

    manifest.update_manifest(run_dir, tokenizer=str(qwen_tokenizer_dir()))
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--per-step", type=int, default=1024)
    parser.add_argument("--record-steps", type=int, default=8)
    parser.add_argument("--record-per-step", type=int, default=256)
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="rlreplay-bench-audit-"))
    root.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, ...]] = []
    try:
        t = time.perf_counter()
        run_dir = build_listing_run(root, args.steps, args.per_step)
        print(f"built {run_dir.name} in {time.perf_counter() - t:.0f} s", flush=True)
        measure(["ls", str(run_dir), "--limit", "1"])  # writes the run index, as any first listing does
        for check, query in (("group_collapse", DUCKDB_COLLAPSE), ("mismatch", DUCKDB_MISMATCH)):
            took, peak, found = measure(["audit", str(run_dir), "--checks", check, "--json"])
            inside = in_process(run_dir, check)
            duck, duck_rows = duckdb_time(query, run_dir)
            assert found == duck_rows, (check, found, duck_rows)
            rows.append(
                (
                    f"{args.steps} x {args.per_step}",
                    check,
                    f"{found:,}",
                    f"{took:.2f} s",
                    f"{inside:.2f} s",
                    f"{peak:.0f} MB",
                    f"{duck:.2f} s",
                    f"{inside / duck:.2f}x",
                )
            )
            print(rows[-1], flush=True)
        t = time.perf_counter()
        rec = record_run(root, args.record_steps, args.record_per_step)
        print(f"recorded {rec.name} in {time.perf_counter() - t:.0f} s", flush=True)
        measure(["ls", str(rec), "--limit", "1"])
        took, peak, found = measure(["audit", str(rec), "--json"])
        n = args.record_steps * args.record_per_step
        rows.append(
            (
                f"{args.record_steps} x {args.record_per_step} (recorded)",
                "all 11 checks",
                f"{found:,}",
                f"{took:.1f} s",
                f"{took / n * 1000:.1f} ms a trajectory",
                f"{peak:.0f} MB",
                "-",
                "-",
            )
        )
        print(rows[-1], flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(
        "| run | checks | findings | rlreplay audit (process) | audit in-process | peak memory "
        "| DuckDB over span files | in-process / DuckDB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
