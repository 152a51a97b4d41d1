"""Engine benchmark: ``mismatch`` and ``audit`` over a whole generated run with ``--engine local``
and with ``--engine ray`` on a real Ray cluster on this machine of 1 and then 2 worker nodes (one
CPU each), in one sitting; every answer checked equal to the local one.

The run is bench_mismatch.py's (one step of PER_STEP trajectories of ~2,000 response tokens, or
``--tokens``,
recorded with the real recorder, with the trainer's per-token log-probs, written again as STEPS
steps over two workers). Each command runs through the library as the CLI runs it (the driver is
this process, so the tasks' own figures can be read): its wall time, and per task (a part of one
or more steps, ``RLREPLAY_PART_BYTES``; again with parts smaller than a step, ``--cut-bytes``)
the time inside the task, the bytes of span files it read, the peak resident memory of the
worker process while it ran the task and how much of that the task added to what the worker
held when it began. Per-task overhead: the wall time
of tasks that only open the run (as many as the parts), a task at a time.

    python benchmarks/bench_engine.py                             # 300 x 1,024 (>= 60 s locally)
    python benchmarks/bench_engine.py --steps 8 --per-step 64     # small, to see that it works
    python benchmarks/bench_engine.py --keep DIR                  # keep (or reuse) the run in DIR
    python benchmarks/bench_engine.py --steps 320 --per-step 256 --tokens 8192  # 8k-token trajectories
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from rlreplay import engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mismatch import TOKENS, run_name


def opened(run_dir: Path):
    from rlreplay.read.open import open_run

    return open_run(run_dir)


def mismatch(run_dir: Path, cluster) -> tuple[float, list]:
    """(seconds, the per-step rows) of ``rlreplay mismatch RUN --json``."""
    from rlreplay.mismatch import metrics
    from rlreplay.mismatch.report import LISTING_COLUMNS, compute

    started = time.perf_counter()
    run = opened(run_dir)
    listing = run.trajectories().select(LISTING_COLUMNS)
    pieces = counts = None
    if cluster is not None:
        limits = (metrics.INVESTIGATE, metrics.BROKEN)
        pieces, counts = engine.mismatch_pieces(run, listing, "step", False, limits, cluster)
    report = compute(run, listing, token_ids=False, pieces=pieces, counts=counts)
    return time.perf_counter() - started, [orjson.dumps(row) for row in report.steps]


def audit(run_dir: Path, cluster) -> tuple[float, list]:
    """(seconds, the findings) of ``rlreplay audit RUN --json`` (every check)."""
    from rlreplay.audit import engine as checks

    started = time.perf_counter()
    run = opened(run_dir)
    listing = run.trajectories()
    chosen = list(checks.available().values())
    if cluster is None:
        report = checks.audit(run, listing, chosen)
    else:
        report = engine.audit(run, listing, chosen, None, None, cluster)
    return time.perf_counter() - started, [orjson.dumps(f.to_dict()) for f in report.findings]


def open_only(run, listing) -> None:
    """A task that opens the run and reads nothing: what a task costs besides its work."""
    return None


def overhead(run_dir: Path, cluster, tasks: int) -> float:
    """Seconds a task that only opens the run adds, end to end (``tasks`` of them over the
    cluster, after as many to start its workers): Ray's scheduling, the run opened, the answer."""
    import pyarrow as pa

    run = opened(run_dir)
    empty = pa.table({"id": pa.array([], pa.string())})
    list(cluster.map(run, [(open_only, empty, None)] * tasks, "warm-up"))
    started = time.perf_counter()
    list(cluster.map(run, [(open_only, empty, None)] * tasks, "noop"))
    return (time.perf_counter() - started) * cluster.cpus / tasks


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--per-step", type=int, default=1024)
    parser.add_argument(
        "--tokens", type=int, help="response tokens a trajectory, on average (uniform within 10%%)"
    )
    parser.add_argument("--keep", type=Path, help="keep the generated run here (reused when present)")
    parser.add_argument("--commands", default="mismatch,audit")
    parser.add_argument(
        "--cut-bytes",
        type=int,
        default=1 << 20,
        help="a part size smaller than a step (RLREPLAY_PART_BYTES), run after the default one",
    )
    args = parser.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-engine-"))
    tokens = TOKENS if args.tokens is None else (args.tokens * 9 // 10, args.tokens * 11 // 10)
    run_dir = root / run_name(args.steps, args.per_step, tokens)
    if not run_dir.exists():
        root.mkdir(parents=True, exist_ok=True)
        print(f"building {args.steps} x {args.per_step} ...", file=sys.stderr)
        # in a process of its own: the recorder it starts stays out of the measured one
        build = "import sys; from pathlib import Path; from bench_mismatch import build_run; "
        build += "a = sys.argv[1:]; build_run(Path(a[0]), int(a[1]), int(a[2]), (int(a[3]), int(a[4])))"
        argv = [str(root), str(args.steps), str(args.per_step), *map(str, tokens)]
        subprocess.run([sys.executable, "-c", build, *argv], check=True, cwd=Path(__file__).resolve().parent)
    files = list(run_dir.glob("spans/*/*/*.parquet"))
    stored = sum(f.stat().st_size for f in files)
    parts = len(engine.plan(opened(run_dir), opened(run_dir).trajectories()))
    pieces = len(engine.plan(opened(run_dir), opened(run_dir).trajectories(), args.cut_bytes))
    shape = f"{args.steps} steps x {args.per_step} x {tokens[0]:,}-{tokens[1]:,} tokens"
    size = f"{len(files)} files, {stored / 1e6:,.0f} MB"
    print(f"run: {shape}, {size}, {parts} parts ({pieces} at {args.cut_bytes:,} B)")
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    commands = {"mismatch": mismatch, "audit": audit}
    chosen = [c.strip() for c in args.commands.split(",")]

    import ray
    from ray.cluster_utils import Cluster

    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        rows = []
        expected: dict[str, list] = {}  # per command, its local answer
        for workers in (1, 2):
            if workers == 2:
                made.add_node(num_cpus=1)
            made.wait_for_nodes()
            ray.shutdown()  # connected again, to the cluster as it is now
            cluster = engine.connect(made.address)
            cluster.progress, cluster.stay = False, True
            cost = overhead(run_dir, cluster, 16)
            for name in chosen:
                if workers == 1:
                    took, expected[name] = commands[name](run_dir, None)
                    rows.append((name, "local", took, None, None, None, None))
                    commands[name](run_dir, cluster)  # once untimed: workers started, files cached
                for part in (None, args.cut_bytes):
                    if part is None:
                        os.environ.pop("RLREPLAY_PART_BYTES", None)
                    else:
                        os.environ["RLREPLAY_PART_BYTES"] = str(part)
                    cluster.answers.clear()
                    took, answer = commands[name](run_dir, cluster)
                    if answer != expected[name]:
                        raise SystemExit(f"{name}: --engine ray answered otherwise")
                    tasks = list(cluster.answers)
                    how = f"ray, {workers} worker{'s' if workers > 1 else ''}"
                    how += "" if part is None else f", parts of {part / 1e6:g} MB"
                    inside = sum(a.seconds for a in tasks)
                    read = sum(a.bytes_read for a in tasks)
                    worst = max(tasks, key=lambda a: a.peak_rss)
                    grown = max(a.peak_rss - a.rss_before for a in tasks)
                    rows.append((name, how, took, len(tasks), inside, read, (worst.peak_rss, grown)))
                os.environ.pop("RLREPLAY_PART_BYTES", None)
            opens = "(a task that opens the run)", f"ray, {workers} worker(s), per task"
            rows.append((*opens, cost, None, None, None, None))
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
        print()
        head = "| command | engine | wall | tasks | time in tasks | bytes read | peak memory a worker "
        print(head + "| most a task added to it |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for name, how, took, n, inside, read, peak in rows:
            cells = [
                name,
                how,
                f"{took * 1000:.0f} ms" if name.startswith("(") else f"{took:.2f} s",
                "" if n is None else str(n),
                "" if inside is None else f"{inside:.2f} s",
                "" if read is None else f"{read / 1e6:,.0f} MB",
                "" if peak is None else f"{peak[0] / 1e6:,.0f} MB",
                "" if peak is None else f"{peak[1] / 1e6:,.0f} MB",
            ]
            print("| " + " | ".join(cells) + " |")
    finally:
        ray.shutdown()
        made.shutdown()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
