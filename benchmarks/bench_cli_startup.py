"""CLI start-up: whole-process ``rlreplay`` commands against ``python -c "import pyarrow"`` and
``ls --step K`` against DuckDB's whole process listing the same step from the same files.

Every command runs ``--repeats`` times, interleaved (one round runs each command once), so load
changes on a shared machine hit all of them alike. Reports the median wall time and the median
CPU time (user + system of the process, steadier than wall time on a loaded machine). The
commands run as an installed package does, with bytecode cached (``PYTHONDONTWRITEBYTECODE`` is
dropped from their environment; a warm-up round writes it).

    python benchmarks/bench_cli_startup.py                     # the shipped sample run, step 5
    python benchmarks/bench_cli_startup.py --run DIR --step K  # e.g. a run kept by bench_scale.py
    python benchmarks/bench_cli_startup.py --before REV        # also rlreplay as of git revision REV
"""

from __future__ import annotations

import argparse
import atexit
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
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
# Commands run in an empty directory: nothing there shadows the installed package.
CWD = tempfile.mkdtemp(prefix="rlreplay-bench-cwd-")
atexit.register(shutil.rmtree, CWD, True)


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one process; its output goes to a pipe."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, cwd=CWD, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.decode()[-500:]}")
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


Case = tuple[str, list[str], dict[str, str]]


def measure(cases: list[Case], repeats: int) -> dict[str, tuple[float, float, float]]:
    """Median wall, median CPU and least CPU seconds of each case, interleaved round by round."""
    walls: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    cpus: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    for _, argv, env in cases:
        timed(argv, env)  # warm-up: bytecode written, files in the page cache
    for _ in range(repeats):
        for label, argv, env in cases:
            wall, cpu = timed(argv, env)
            walls[label].append(wall)
            cpus[label].append(cpu)
    return {
        label: (statistics.median(walls[label]), statistics.median(cpus[label]), min(cpus[label]))
        for label in walls
    }


def table(title: str, base: str, results: dict[str, tuple[float, float, float]], repeats: int) -> None:
    base_wall, base_cpu, base_least = results[base]
    print(f"\n{title}\n")
    print(f"| command | wall, median of {repeats} | / base | CPU, median | / base | CPU, least | / base |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, (wall, cpu, least) in results.items():
        print(
            f"| `{label}` | {wall * 1000:,.0f} ms | {wall / base_wall:.2f}x "
            f"| {cpu * 1000:,.0f} ms | {cpu / base_cpu:.2f}x "
            f"| {least * 1000:,.0f} ms | {least / base_least:.2f}x |"
        )


def older_rlreplay(rev: str) -> Path:
    """rlreplay as of git revision ``rev``, laid out as an importable package in a temp directory
    (for PYTHONPATH, ahead of the installed one)."""
    tree = Path(tempfile.mkdtemp(prefix="rlreplay-before-"))
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    src = tree / "src"
    src.mkdir()
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = tree / "pkg" / "rlreplay"
    shutil.copytree(src / "rlreplay", pkg)
    for name in ("cli", "recorders", "uploaders"):  # pyproject's package-dir mapping
        shutil.copytree(src / name, pkg / name)
    return tree / "pkg"


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
        help="rlreplay's own modules compiled in every process (its cached bytecode removed, "
        "PYTHONDONTWRITEBYTECODE=1), as in a development checkout with that setting",
    )
    parser.add_argument("--before", metavar="REV", help="also time the rlreplay commands of git revision REV")
    args = parser.parse_args()
    if args.no_bytecode:
        ENV["PYTHONDONTWRITEBYTECODE"] = "1"
        for package in ("rlreplay", "cli", "recorders", "uploaders"):
            for cache in (ROOT / package).rglob("__pycache__"):
                shutil.rmtree(cache)
    python = sys.executable
    run = str(args.run.resolve())
    label_run = "SAMPLE_RUN" if args.run.resolve() == SAMPLE_RUN else "RUN"
    rlreplay = [python, "-m", "rlreplay"]
    versions = [("", ENV)]
    if args.before:
        older = older_rlreplay(args.before)
        versions.append((f" ({args.before})", {**ENV, "PYTHONPATH": str(older)}))

    bytecode = "no cached bytecode" if ENV.get("PYTHONDONTWRITEBYTECODE") else "cached bytecode"
    print(f"# {python}; run {run}; {bytecode}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}")
    startup: list[Case] = [('python -c "import pyarrow"', [python, "-c", "import pyarrow"], ENV)]
    step: list[Case] = [
        (
            f"DuckDB listing of step {args.step} (python -c)",
            [python, "-c", DUCKDB_LS, run, str(args.step)],
            ENV,
        )
    ]
    for suffix, env in versions:
        startup += [
            (f"rlreplay --help{suffix}", [*rlreplay, "--help"], env),
            (f"rlreplay ls {label_run}{suffix}", [*rlreplay, "ls", run], env),
            (f"rlreplay ls {label_run} --json{suffix}", [*rlreplay, "ls", run, "--json"], env),
        ]
        step.append(
            (
                f"rlreplay ls {label_run} --step {args.step}{suffix}",
                [*rlreplay, "ls", run, "--step", str(args.step)],
                env,
            )
        )
    table(
        "CLI start-up against `import pyarrow` (output to a pipe)",
        startup[0][0],
        measure(startup, args.repeats),
        args.repeats,
    )
    table(
        f"`ls --step {args.step}` against DuckDB over the same span files",
        step[0][0],
        measure(step, args.repeats),
        args.repeats,
    )
    if args.before:
        shutil.rmtree(older.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
