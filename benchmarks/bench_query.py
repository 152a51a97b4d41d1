"""Query benchmark: ``ls --where``, ``stats`` and a step-range ``ls --sort --limit`` over a whole
synthetic run, each against the same question written directly in DuckDB over the same files;
then CLI start-up against ``python -c "import pyarrow"``.

Each step is the shipped sample run's step 5 (real span shapes: trajectory, agent, llm, parser,
tool) replicated to N trajectories with small payloads and random rewards, written as sealed
shards with the shard writer (2 workers, one file per worker and step).

    python benchmarks/bench_query.py                         # 50 and 200 steps x 256 trajectories
    python benchmarks/bench_query.py --per-step 1024         # the issue's size (200 x 1,024)
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import rlreplay
from rlreplay.format.schema import PAYLOAD_COLUMNS
from rlreplay.read import query
from rlreplay.read.selection import Selection
from rlreplay.shards.layout import partition_dir
from rlreplay.shards.seal import write_sealed

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import synthetic_run  # noqa: E402  (tests/: the run builder the UI tests share)
from synthetic_run import as_step  # noqa: E402

SAMPLE_RUN = ROOT / "sample_runs" / "gsm8k-grpo-qwen3"
TEMPLATE_STEP = 5
WHERE = "reward > 0 and model_calls >= 3"
RANGE = (150, 160)
RANGE_EARLY = (30, 40)  # in every run size: shows how a step range scales


def step_template(per_step: int) -> pa.Table:
    """One step of spans: the sample run's step, replicated to ``per_step`` trajectories."""
    base = rlreplay.open_run(SAMPLE_RUN).spans(step=TEMPLATE_STEP)
    base = base.filter(pc.invert(pc.fill_null(base["validate"], False)))
    for name in PAYLOAD_COLUMNS:
        if name in base.column_names and pa.types.is_large_string(base.schema.field(name).type):
            base = base.set_column(
                base.column_names.index(name), name, pa.array(['{"n": 1}'] * base.num_rows, pa.large_string())
            )
    rng = np.random.default_rng(1)
    for name, kinds in (("response_tokens", ("agent", "llm")), ("prompt_tokens", ("agent", "llm"))):
        if name in base.column_names:
            counted = pc.is_in(base["kind"], pa.array(kinds)).to_numpy(zero_copy_only=False)
            values = pa.array(rng.integers(50, 4000, base.num_rows), mask=~counted)
            base = base.set_column(base.column_names.index(name), name, values)
    per_copy = len(set(base["trajectory_id"].to_pylist()))
    return synthetic_run.replicate(base, max(1, per_step // per_copy), 10_000)


def build_run(
    root: Path, template: pa.Table, steps: int, seed: int = 0, draw: Callable[[Any, int], Any] | None = None
) -> Path:
    """``steps`` copies of ``template``, rewards drawn by ``draw(rng, n)`` (default: uniform, 3 places)."""
    run_dir = root / f"run-{steps}"
    rng = np.random.default_rng(seed)
    workers = sorted(set(template["worker"].to_pylist()))
    rewarded = pc.is_valid(template["reward"]).to_numpy(zero_copy_only=False)
    for step in range(steps):
        drawn = draw(rng, template.num_rows) if draw is not None else rng.random(template.num_rows).round(3)
        rewards = np.where(rewarded, drawn, np.nan)
        table = template.set_column(
            template.column_names.index("reward"), "reward", pa.array(rewards, mask=~rewarded)
        )
        table = as_step(table, step)
        for worker in workers:
            folder = partition_dir(run_dir, step, worker)
            folder.mkdir(parents=True, exist_ok=True)
            write_sealed(
                table.filter(pc.equal(table["worker"], worker)), folder / f"part-bench-{step}.parquet"
            )
    (run_dir / "run.json").write_text('{"format_version": 1}')
    return run_dir


# --- the same questions, straight in DuckDB over the span files ---------------------------------

_PER_TRAJECTORY = """
SELECT trajectory_id AS id, any_value(step) AS step, any_value(sample_index) AS sample_index,
    any_value(rollout_n) AS rollout_n, any_value(validate) AS validate,
    min(start_ns) / 1e9 AS start_time, (max(end_ns) - min(start_ns)) / 1e9 AS duration_s,
    count(*) AS num_spans, count(*) FILTER (kind = 'llm') AS model_calls,
    count(*) FILTER (kind = 'tool') AS tool_calls,
    count(*) FILTER (kind = 'tool' AND status = 'error') AS tool_errors,
    coalesce(any_value(status) FILTER (parent_id IS NULL), 'incomplete') AS status,
    arg_max(reward, end_ns) FILTER (kind IN ('signals', 'agent', 'trajectory') AND reward IS NOT NULL)
        AS reward
FROM read_parquet('{files}', hive_partitioning = {hive}) {where}
GROUP BY trajectory_id
"""


def direct_where(con: Any, run_dir: Path) -> pa.Table:
    per = _PER_TRAJECTORY.format(files=run_dir / "spans/*/*/*.parquet", hive="false", where="")
    return con.sql(
        f"SELECT * FROM ({per}) WHERE {WHERE} ORDER BY step, sample_index, rollout_n, start_time"
    ).to_arrow_table()


def direct_stats(con: Any, run_dir: Path) -> pa.Table:
    per = _PER_TRAJECTORY.format(files=run_dir / "spans/*/*/*.parquet", hive="false", where="")
    return con.sql(
        f"""WITH t AS ({per}),
        g AS (SELECT step, validate, sample_index, count(reward) AS n, min(reward) = max(reward) AS same
              FROM t GROUP BY ALL),
        gs AS (SELECT step, validate, avg(CASE WHEN same THEN 1.0 ELSE 0.0 END) FILTER (n >= 2) AS z
               FROM g GROUP BY ALL)
        SELECT t.step, t.validate, count(*), count(DISTINCT sample_index), avg(reward) AS reward_mean,
            stddev_pop(reward),
            avg(CASE WHEN reward > 0 THEN 1.0 WHEN reward IS NOT NULL THEN 0.0 END), any_value(gs.z),
            avg(model_calls), avg(tool_calls), sum(tool_errors) / nullif(sum(tool_calls), 0),
            avg(CASE WHEN status = 'error' THEN 1.0 ELSE 0.0 END),
            quantile_cont(duration_s, 0.5), quantile_cont(duration_s, 0.95)
        FROM t LEFT JOIN gs ON t.step = gs.step AND t.validate = gs.validate
        GROUP BY t.step, t.validate ORDER BY t.step, t.validate"""
    ).to_arrow_table()


def direct_range(con: Any, run_dir: Path, bounds: tuple[int, int] = RANGE) -> pa.Table:
    lo, hi = bounds
    per = _PER_TRAJECTORY.format(
        files=run_dir / "spans/step=*/worker=*/*.parquet",
        hive="true",
        where=f"WHERE step BETWEEN {lo} AND {hi}",
    )
    return con.sql(f"SELECT * FROM ({per}) ORDER BY reward DESC NULLS LAST LIMIT 20").to_arrow_table()


_PER_TRAJECTORY_INDEX = """
SELECT id, any_value(step) AS step, any_value(sample_index) AS sample_index,
    any_value(rollout_n) AS rollout_n, any_value(validate) AS validate, min(start_ns) / 1e9 AS start_time,
    sum(model_calls) AS model_calls, sum(tool_calls) AS tool_calls,
    coalesce(arg_max(reward_sig, reward_sig_end), arg_max(reward_agent, reward_agent_end)) AS reward
FROM read_parquet('{files}', hive_partitioning = {hive}) {where}
GROUP BY id
"""


def direct_index(con: Any, run_dir: Path, label: str) -> pa.Table:
    """The ls questions over the per-shard trajectory index files (what rlreplay reads)."""
    if label.startswith("ls --where"):
        per = _PER_TRAJECTORY_INDEX.format(files=run_dir / "spans/*/*/*.index", hive="false", where="")
        query = f"SELECT * FROM ({per}) WHERE {WHERE} ORDER BY step, sample_index, rollout_n, start_time"
    else:
        lo, hi = (int(x) for x in label.split()[2].split(".."))
        per = _PER_TRAJECTORY_INDEX.format(
            files=run_dir / "spans/step=*/worker=*/*.index",
            hive="true",
            where=f"WHERE step BETWEEN {lo} AND {hi}",
        )
        query = f"SELECT * FROM ({per}) ORDER BY reward DESC NULLS LAST LIMIT 20"
    return con.sql(query).to_arrow_table()


def ours_where(run_dir: Path) -> pa.Table:
    return Selection(where=WHERE).trajectories(rlreplay.open_run(run_dir))


def ours_stats(run_dir: Path) -> pa.Table:
    return query.stats(rlreplay.open_run(run_dir))


def ours_range(run_dir: Path, bounds: tuple[int, int] = RANGE) -> pa.Table:
    lo, hi = bounds
    return Selection(step=f"{lo}..{hi}", sort="reward desc", limit=20).trajectories(
        rlreplay.open_run(run_dir)
    )


def best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def startup(argv: list[str], repeats: int) -> tuple[float, float]:
    """Median wall and CPU (user + system) seconds of a command, run ``repeats`` times."""
    import resource

    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", default="50,200", help="run sizes in steps (comma-separated)")
    parser.add_argument("--per-step", type=int, default=256, help="trajectories per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="build the runs here and keep them")
    args = parser.parse_args()

    template = step_template(args.per_step)
    n_traj = len(set(template["trajectory_id"].to_pylist()))
    print(f"template: {n_traj} trajectories, {template.num_rows} spans per step")
    root = args.keep or Path(tempfile.mkdtemp(prefix="rlreplay-bench-query-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = run_queries(root, template, args)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(
        "| steps | query | rows | rlreplay | DuckDB over span files | rlreplay / that "
        "| DuckDB over index files | rlreplay / that |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for steps, label, n, ours, direct, index in rows:
        via_index = f"{index * 1000:,.0f} ms | {ours / index:.2f}x" if index else "| "
        label, _, note = label.partition("  # ")
        shown = f"`{label}` {note}".strip()
        print(
            f"| {steps} | {shown} | {n:,} | {ours * 1000:,.0f} ms | {direct * 1000:,.0f} ms "
            f"| {ours / direct:.2f}x | {via_index} |"
        )
    print()
    startup_table()


def run_queries(root: Path, template: pa.Table, args: argparse.Namespace) -> list[tuple]:
    import duckdb

    n_traj = len(set(template["trajectory_id"].to_pylist()))
    rows = []
    for steps in [int(s) for s in args.steps.split(",")]:
        start = time.perf_counter()
        run_dir = build_run(root, template, steps)
        built = time.perf_counter() - start
        print(
            f"built {steps} steps ({steps * n_traj:,} trajectories, "
            f"{steps * template.num_rows:,} spans) in {built:.1f}s"
        )
        con = duckdb.connect()
        t_direct, expect = best(lambda c=con, r=run_dir: direct_where(c, r), args.repeats)
        t_first, got = best(lambda r=run_dir: ours_where(r), 1)  # no run index yet: writes it
        assert got.num_rows == expect.num_rows
        rows.append(
            (
                steps,
                f'ls --where "{WHERE}"  # first, writes the run index',
                got.num_rows,
                t_first,
                t_direct,
                None,
            )
        )
        for label, ours, direct in (
            (f'ls --where "{WHERE}"', ours_where, direct_where),
            ("stats", ours_stats, direct_stats),
            (f'ls --step {RANGE[0]}..{RANGE[1]} --sort "reward desc" --limit 20', ours_range, direct_range),
            (
                f'ls --step {RANGE_EARLY[0]}..{RANGE_EARLY[1]} --sort "reward desc" --limit 20',
                lambda r: ours_range(r, RANGE_EARLY),
                lambda c, r: direct_range(c, r, RANGE_EARLY),
            ),
        ):
            t_direct, expect = best(lambda d=direct, c=con, r=run_dir: d(c, r), args.repeats)
            t_ours, got = best(lambda o=ours, r=run_dir: o(r), args.repeats)
            assert got.num_rows == expect.num_rows, (label, got.num_rows, expect.num_rows)
            if "--limit" in label:
                assert got["reward"].to_pylist() == expect["reward"].to_pylist()
            elif label == "stats":
                pairs = zip(got["reward_mean"].to_pylist(), expect["reward_mean"].to_pylist())
                assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in pairs)
            else:
                assert sorted(got["id"].to_pylist()) == sorted(expect["id"].to_pylist())
            t_index = None
            if label.startswith("ls"):
                t_index, via_index = best(
                    lambda c=con, r=run_dir, q=label: direct_index(c, r, q), args.repeats
                )
                same = "reward" if "--limit" in label else "id"  # ties at the limit: compare rewards
                assert sorted(via_index[same].to_pylist()) == sorted(got[same].to_pylist())
            rows.append((steps, label, got.num_rows, t_ours, t_direct, t_index))
    return rows


def startup_table() -> None:
    python = sys.executable
    base_wall, base_cpu = startup([python, "-c", "import pyarrow"], 7)
    cases = [
        ("rlreplay --help", [python, "-m", "rlreplay", "--help"]),
        ("rlreplay ls SAMPLE_RUN", [python, "-m", "rlreplay", "ls", str(SAMPLE_RUN)]),
        ("rlreplay ls SAMPLE_RUN --json", [python, "-m", "rlreplay", "ls", str(SAMPLE_RUN), "--json"]),
    ]
    print("| command | wall, median of 7 | / pyarrow | CPU, median of 7 | / pyarrow |")
    print("|---|---:|---:|---:|---:|")
    print(
        f'| `python -c "import pyarrow"` | {base_wall * 1000:,.0f} ms | 1.00x '
        f"| {base_cpu * 1000:,.0f} ms | 1.00x |"
    )
    for label, argv in cases:
        wall, cpu = startup(argv, 7)
        print(
            f"| `{label}` | {wall * 1000:,.0f} ms | {wall / base_wall:.2f}x "
            f"| {cpu * 1000:,.0f} ms | {cpu / base_cpu:.2f}x |"
        )


if __name__ == "__main__":
    main()
