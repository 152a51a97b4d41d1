"""Audit benchmark: ``rlreplay audit`` over whole synthetic runs, time and peak memory.

1. Listing checks (``group_collapse``, ``mismatch``) over a 200 x 1,024-trajectory run built as
   ``bench_query.py`` builds its runs (the sample run's step 5 replicated, random rewards and
   trainer-vs-rollout differences), against the same questions written directly in DuckDB over
   the span files.
2. Every check (the trajectory checks stream each step's spans) over a run recorded with the real
   recorder and ``agent_workload.py``'s agent loop (real Qwen3 ids, 2-5 model calls per trajectory,
   a tool call between them) for two steps, written again as RECORD_STEPS steps as
   ``bench_compare.py`` does (or a run it kept), audited whole or over its first AUDIT_STEPS
   steps, optionally with another checkout's code first; against a pyarrow read of the same span
   files (the floor).

Peak memory is the audit process's maximum resident set size.

    python benchmarks/bench_audit.py                                        # 200 x 1,024 both
    python benchmarks/bench_audit.py --steps 0 --recorded-run DIR/a-200     # a run bench_compare kept, whole
    python benchmarks/bench_audit.py --steps 0 --recorded-run DIR/a-200 --audit-steps 2 \
        --baseline-tree /path/to/other/checkout                             # before and after a change
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_compare
from bench_query import build_run, step_template

ROOT = Path(__file__).resolve().parent.parent


def measure(args: list[str], tree: Path | None = None) -> tuple[float, float, int]:
    """(seconds, peak MB, lines of output) of ``rlreplay ARGS`` as its own process (``tree``:
    another checkout, run with its own ``.venv`` from its folder; default this one)."""
    python = str(tree / ".venv" / "bin" / "python") if tree is not None else sys.executable
    took, peak, rc, out = bench_compare.measure([python, "-m", "rlreplay", *args], tree or ROOT)
    assert rc in (0, 1), f"rlreplay {' '.join(args)} exited {rc}"
    return took, peak, out.count(b"\n")


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


def pyarrow_read(run_dir: Path, steps: int) -> float:
    """Seconds to read every column of the span files of steps 0..steps-1, a file at a time."""
    import pyarrow.parquet as pq

    t = time.perf_counter()
    for step in range(steps):
        for path in sorted((run_dir / "spans" / f"step={step}").glob("*/*.parquet")):
            pq.read_table(path)
    return time.perf_counter() - t


def audit_recorded(rec: Path, audit_steps: int | None, baseline: Path | None) -> list[tuple[str, ...]]:
    """Part 2: every check over steps 0..audit_steps-1 of a recorded run (default: the whole run,
    no selection), after the code of ``baseline`` (a source tree) when given."""
    from rlreplay.read.open import open_run

    run = open_run(rec)
    all_steps = len(run.step_partitions())
    steps = audit_steps or all_steps
    listing = run.trajectories()
    n = int(pc.sum(pc.less(listing["step"], steps)).as_py() or 0)
    selection = ["--step", f"0..{steps - 1}"] if steps < all_steps else []
    measure(["ls", str(rec), "--limit", "1"])
    rows = []
    for tree in ([baseline] if baseline else []) + [None]:
        took, peak, found = measure(["audit", str(rec), *selection, "--json"], tree)
        scan = pyarrow_read(rec, steps)
        rows.append(
            (
                f"{steps} x {n // steps:,} (recorded)" + (f", code of {tree}" if tree else ""),
                "all 11 checks",
                f"{found:,}",
                f"{took:.1f} s",
                f"{took / n * 1000:.2f} ms a trajectory",
                f"{peak:.0f} MB",
                f"pyarrow read of the span files {scan:.1f} s",
                f"{took / scan:.1f}x",
            )
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="part 1's steps (0: skip part 1)")
    parser.add_argument("--per-step", type=int, default=1024)
    parser.add_argument("--record-steps", type=int, default=200)
    parser.add_argument("--record-per-step", type=int, default=1024)
    parser.add_argument("--audit-steps", type=int, help="audit steps 0..N-1 only (default: all)")
    parser.add_argument("--recorded-run", type=Path, help="a run bench_compare.py built (--keep DIR: DIR/a)")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="also audit part 2's run with the checkout here (its .venv), first",
    )
    parser.add_argument("--keep", type=Path)
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="rlreplay-bench-audit-"))
    root.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, ...]] = []
    try:
        if args.steps:  # part 1
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
        rec = args.recorded_run
        if rec is None:
            base = bench_compare.record(root / "base", min(2, args.record_steps), args.record_per_step)
            rec = root / "recorded"
            bench_compare.replicate(base, rec, args.record_steps)
            print(f"recorded and replicated {rec.name} in {time.perf_counter() - t:.0f} s", flush=True)
        rows += audit_recorded(rec, args.audit_steps, args.baseline_tree)
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
