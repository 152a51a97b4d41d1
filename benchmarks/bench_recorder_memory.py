"""Recorder memory: peak RSS of a recording process over the same process untraced.

Two workloads, each run in fresh processes (traced and untraced, same code and imports: pyarrow
is imported and warmed in both), peak RSS from the kernel (``wait4`` ru_maxrss):
- saturated: 4 threads making token spans as fast as they can (8,000 prompt + 1,000 response ids,
  fresh Python ints, step -1), so the writer cannot keep up: the queue cap and the spill path hold.
- big step: one step that never ends (step -1) receiving ``--step-mb`` MB of span payload, paced
  so the writer keeps up; live files rotate and are sealed on the sealing thread meanwhile.

    python benchmarks/bench_recorder_memory.py [--saturated-s 10] [--step-mb 256]
    python benchmarks/bench_recorder_memory.py --step-mb 2048        # the 2 GB step
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import json, os, random, sys, threading, time
    import pyarrow as pa
    pa.array([0])  # the same imports in both variants
    mode, traced, run_dir, amount = sys.argv[1], sys.argv[2] == "1", sys.argv[3], float(sys.argv[4])
    if traced:
        import rlreplay
        rlreplay.init(run_dir, worker="bench")
        op = rlreplay.trace_op(kind="llm")
        trajectory = rlreplay.trajectory
    else:
        import contextlib
        op = lambda f: f
        trajectory = lambda **kw: contextlib.nullcontext()

    @op
    def generate(request_id, *, prompt_ids):
        rng = random.Random(request_id)
        return {"token_ids": [rng.randrange(151_000) for _ in range(1000)]}

    def prompt(seed, n):
        rng = random.Random(seed)
        return [rng.randrange(151_000) for _ in range(n)]

    made = [0]
    started = time.monotonic()
    if mode == "saturated":
        def work(t):
            i = 0
            while time.monotonic() - started < amount:
                with trajectory(step=-1, sample_index=t * 1_000_000 + i):
                    generate(f"{t}-{i}", prompt_ids=prompt(i, 8000))
                made[0] += 2
                i += 1
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads: th.start()
        for th in threads: th.join()
    else:
        # ~9,000 ids per span pair as JSON text is ~60 KB: amount MB of payload
        pairs = int(amount * (1 << 20) / 60_000)
        for i in range(pairs):
            with trajectory(step=-1, sample_index=i):
                generate(str(i), prompt_ids=prompt(i, 8000))
            made[0] += 2
            if traced and i % 64 == 63:
                rlreplay.flush()
    took = time.monotonic() - started
    stats = {}
    if traced:
        from rlreplay.recorder import get_recorder
        recorder = get_recorder()
        rlreplay.close()
        stats = recorder.counters
    print(json.dumps({"made": made[0], "seconds": took, "stats": stats}))
    """
)


def run(mode: str, traced: bool, run_dir: Path, amount: float) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, "1" if traced else "0", str(run_dir), str(amount)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{mode} traced={traced} failed ({proc.returncode})")
    return {**json.loads(out), "peak_mb": usage.ru_maxrss / 1024}


def files(run_dir: Path) -> tuple[int, int]:
    sealed = list(run_dir.glob("spans/*/*/*.parquet"))
    return len(sealed), sum(p.stat().st_size for p in sealed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--saturated-s", type=float, default=10.0, help="seconds of saturated recording")
    parser.add_argument("--step-mb", type=float, default=256.0, help="MB of payload in the big step")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rlreplay-bench-mem-"))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}")
    print(f"{'workload':34s} {'untraced MB':>12s} {'traced MB':>10s} {'over':>8s}  notes")
    for mode, amount, label in (
        ("saturated", args.saturated_s, f"saturated, 4 threads, {args.saturated_s:g} s"),
        ("bigstep", args.step_mb, f"one step of {args.step_mb:g} MB payload"),
    ):
        run_dir = tmp / mode
        started = time.monotonic()
        base = run(mode, False, tmp / "none", amount)
        traced = run(mode, True, run_dir, amount)
        n_files, size = files(run_dir)
        stats = traced["stats"]
        notes = (
            f"{traced['made']:,} spans made, {stats['spans']:,} written by the writer, "
            f"{stats['spilled']:,} spilled, {stats['lost']} lost; {n_files} sealed files, "
            f"{size / 1e6:,.0f} MB on disk; {time.monotonic() - started:.0f} s"
        )
        over = traced["peak_mb"] - base["peak_mb"]
        print(
            f"{label:34s} {base['peak_mb']:12.0f} {traced['peak_mb']:10.0f} {over:+8.0f}  {notes}", flush=True
        )


if __name__ == "__main__":
    main()
