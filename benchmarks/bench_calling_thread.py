"""The calling thread's own cost per span, without the writer: CPU ns, or instructions under callgrind.

``bench_recorder.py`` times spans with the writer and sealer running beside them, so its per-call
figures move with the machine's load, the allocator and the GIL. Here no writer thread ever starts
(the recorder is marked as started; queued spans are dropped every 8 calls, as a trajectory's
are taken), so only what recording a span costs the thread that made the call is counted:

- tiny spans: ``op(x)`` returning ``x + 1``;
- token spans: ``generate(request_id, *, prompt_ids=<1,000 ids>, sampling_params)`` returning
  ``{"token_ids": <2,000 ids>}``, the token workload of ``bench_recorder.py``.

With ``--callgrind`` each figure is the difference of two runs under callgrind (``valgrind`` on
PATH), garbage collection off and nothing freed in the counted calls: instructions per span,
independent of the load (to compare two trees, run each with ``PYTHONPATH=TREE``).

    python benchmarks/bench_calling_thread.py [--rounds 25]
    python benchmarks/bench_calling_thread.py --callgrind
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CALLS = {"tiny": 20_000, "token": 500}
OUTPUT = {"token_ids": list(range(10_000, 12_000))}


def workload(kind: str) -> tuple[Any, Callable[[], Any]]:
    """A recorder whose writer never runs, and one traced call of ``kind``."""
    import rlreplay
    from rlreplay.recorder import api, writer

    run_dir = Path(tempfile.mkdtemp(prefix="rlreplay-bench-")) / "run"
    rec = writer.Recorder(writer.RecorderConfig(run_dir=run_dir, worker="bench", max_queue_bytes=1 << 40))
    rec._thread = threading.current_thread()  # no writer thread starts: nothing takes the queue
    api._recorder, api._env_checked = rec, True

    @rlreplay.trace_op(kind="llm")
    def tiny(x: int) -> int:
        return x + 1

    @rlreplay.trace_op(kind="llm")
    def generate(request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        return {"token_ids": OUTPUT["token_ids"].copy()}

    prompt, params = list(range(1000)), {"temperature": 1.0}
    if kind == "tiny":
        return rec, lambda: tiny(5)
    return rec, lambda: generate("req", prompt_ids=prompt, sampling_params=params)


def cpu_ns(kind: str, rounds: int) -> tuple[float, float]:
    """(fastest, median) thread CPU ns per span over ``rounds`` rounds."""
    import rlreplay

    rec, call = workload(kind)
    n = CALLS[kind]
    per_span = []
    with rlreplay.trajectory(step=0, sample_index=0):
        for _ in range(rounds):
            started = time.thread_time_ns()
            for i in range(n):
                call()
                if i % 8 == 7:
                    rec._queue.clear()
            per_span.append((time.thread_time_ns() - started) / n)
    per_span.sort()
    return per_span[0], per_span[len(per_span) // 2]


def counted(kind: str, calls: int) -> None:
    """Run ``calls`` spans with callgrind's instrumentation on (this process runs under callgrind)."""
    import rlreplay

    rec, call = workload(kind)
    toggle = ["callgrind_control", "-i"]
    with rlreplay.trajectory(step=0, sample_index=0):
        for _ in range(200):
            call()
        rec._queue.clear()
        gc.disable()
        subprocess.run([*toggle, "on", str(os.getpid())], capture_output=True)
        for _ in range(calls):
            call()
        subprocess.run([*toggle, "off", str(os.getpid())], capture_output=True)
    os._exit(0)  # the queued spans are not written


def instructions(kind: str) -> float:
    """Instructions per span: two runs under callgrind, ``n`` and ``3 n`` calls, differenced."""
    n = CALLS[kind] // 20 if kind == "tiny" else CALLS[kind] // 2
    totals = []
    for calls in (n, 3 * n):
        argv = [sys.executable, __file__, "--counted", kind, str(calls)]
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null", *argv]
        err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        totals.append(int(err.split("Collected :")[1].split()[0]))
    return (totals[1] - totals[0]) / (2 * n)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--callgrind", action="store_true", help="instructions per span (needs valgrind)")
    parser.add_argument("--counted", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.counted:
        return counted(args.counted[0], int(args.counted[1]))
    import rlreplay

    tree = Path(rlreplay.__file__).resolve().parent.parent
    load = os.getloadavg()[0]
    if args.callgrind:
        figures = {kind: f"{instructions(kind):,.0f} instructions" for kind in CALLS}
    else:
        figures = {}
        for kind in CALLS:
            fastest, median = cpu_ns(kind, args.rounds)
            figures[kind] = f"{median:,.0f} ns CPU (fastest {fastest:,.0f})"
    print(f"{tree}, load {load:.1f}: per tiny span {figures['tiny']}; per token span {figures['token']}")


if __name__ == "__main__":
    main()
