"""CLI start-up: whole-process ``rlreplay`` commands against ``python -c "import pyarrow"`` and
``ls --step K`` against DuckDB's whole process listing the same step from the same files.

Every command runs ``--repeats`` times, interleaved (one round runs each command once), so load
changes on a shared machine hit all of them alike. Reports the median wall time and the median
CPU time (user + system of the process, steadier than wall time on a loaded machine). The
commands run as an installed package does, with bytecode cached (``PYTHONDONTWRITEBYTECODE`` is
dropped from their environment; a warm-up round writes it).

    python benchmarks/bench_cli_startup.py                     # the shipped sample run, step 5
    python benchmarks/bench_cli_startup.py --run DIR --step K  # e.g. a run kept by bench_scale.py
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_RUN = ROOT / "sample_runs" / "gsm8k-grpo-qwen3"

# The listing of one step written directly in DuckDB over the step's span files (as bench_scale.py).
DUCKDB_LS = """
import duckdb, sys
files = f"{sys.argv[1]}/spans/step={sys.argv[2]}/*/*.parquet"
duckdb.sql(f'''select trajectory_id, any_value(sample_index), any_value(rollout_n), count(*),
  sum((kind = 'llm')::int), sum((kind = 'tool')::int), min(start_ns), max(end_ns)
  from read_parquet('{files}') group by 1 order by 2, 3''').fetchall()
"""


# As an installed package runs: with its modules' bytecode cached (a warm-up round writes it).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def timed(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one process; its output goes to a pipe."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, cwd=ROOT, env=ENV)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-500:]}")
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def measure(cases: list[tuple[str, list[str]]], repeats: int) -> dict[str, tuple[float, float]]:
    """Median wall and CPU seconds of each case, the cases interleaved round by round."""
    walls: dict[str, list[float]] = {label: [] for label, _ in cases}
    cpus: dict[str, list[float]] = {label: [] for label, _ in cases}
    for _, argv in cases:
        timed(argv)  # warm-up: bytecode written, files in the page cache
    for _ in range(repeats):
        for label, argv in cases:
            wall, cpu = timed(argv)
            walls[label].append(wall)
            cpus[label].append(cpu)
    return {label: (statistics.median(walls[label]), statistics.median(cpus[label])) for label in walls}


def table(title: str, base: str, results: dict[str, tuple[float, float]], repeats: int) -> None:
    base_wall, base_cpu = results[base]
    print(f"\n{title}\n")
    print(f"| command | wall, median of {repeats} | / base | CPU, median of {repeats} | / base |")
    print("|---|---:|---:|---:|---:|")
    for label, (wall, cpu) in results.items():
        print(
            f"| `{label}` | {wall * 1000:,.0f} ms | {wall / base_wall:.2f}x "
            f"| {cpu * 1000:,.0f} ms | {cpu / base_cpu:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", type=Path, default=SAMPLE_RUN, help="run directory (default: sample run)")
    parser.add_argument("--step", type=int, default=5, help="the step ls --step lists")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--no-bytecode",
        action="store_true",
        help="keep PYTHONDONTWRITEBYTECODE as set: rlreplay's modules compiled in every process",
    )
    args = parser.parse_args()
    if args.no_bytecode:
        ENV.update(os.environ)
    python = sys.executable
    run = str(args.run.resolve())
    label_run = "SAMPLE_RUN" if args.run.resolve() == SAMPLE_RUN else "RUN"
    rlreplay = [python, "-m", "rlreplay"]

    bytecode = "no cached bytecode" if ENV.get("PYTHONDONTWRITEBYTECODE") else "cached bytecode"
    print(f"# {python}; run {run}; {bytecode}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}")
    startup = [
        ('python -c "import pyarrow"', [python, "-c", "import pyarrow"]),
        ("rlreplay --help", [*rlreplay, "--help"]),
        (f"rlreplay ls {label_run}", [*rlreplay, "ls", run]),
        (f"rlreplay ls {label_run} --json", [*rlreplay, "ls", run, "--json"]),
    ]
    table(
        "CLI start-up against `import pyarrow` (output to a pipe)",
        startup[0][0],
        measure(startup, args.repeats),
        args.repeats,
    )
    step = [
        (f"DuckDB listing of step {args.step} (python -c)", [python, "-c", DUCKDB_LS, run, str(args.step)]),
        (f"rlreplay ls {label_run} --step {args.step}", [*rlreplay, "ls", run, "--step", str(args.step)]),
    ]
    table(
        f"`ls --step {args.step}` against DuckDB over the same span files",
        step[0][0],
        measure(step, args.repeats),
        args.repeats,
    )


if __name__ == "__main__":
    main()
