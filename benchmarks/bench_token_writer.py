"""The writer's own work on ``bench_recorder.py``'s token spans, on one thread: CPU per span, or
instructions per span under callgrind (independent of the machine's load).

The token workload of ``bench_recorder.py`` (1,000 prompt ids in, 2,000 ids out, 8 calls per
trajectory) is recorded through the real ``trace_op``/``trajectory`` into a list of queue events,
then applied on this thread as the writer thread applies them (``encode_row`` with the prefix
cache, batches, live files), then sealed. Each round writes a new run.

    python benchmarks/bench_token_writer.py [--calls 1600] [--rounds 7]
    PYTHONPATH=OLD_TREE python benchmarks/bench_token_writer.py            # another source tree
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=/dev/null \
        python benchmarks/bench_token_writer.py --calls 400 --callgrind     # instructions per span
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_recorder

import rlreplay
from rlreplay.recorder import writer


def capture(run_dir: Path, calls: int) -> list[Any]:
    """The queue events of ``calls`` token spans (and their trajectories), none written."""
    events: list[Any] = []
    submit, on_end, flush = writer.Recorder.submit, writer.Recorder.on_end, writer.Recorder.flush
    writer.Recorder.submit = lambda self, event: events.append(event)  # type: ignore[method-assign]
    writer.Recorder.on_end = lambda self, span: events.append(span)  # type: ignore[method-assign]
    writer.Recorder.flush = lambda self, timeout=30.0: True  # type: ignore[method-assign]
    try:
        tracer = bench_recorder.RlreplayTracer(run_dir)
        bench_recorder.measure(tracer, bench_recorder.generate, bench_recorder.token_args, calls)
    finally:
        writer.Recorder.submit, writer.Recorder.on_end = submit, on_end  # type: ignore[method-assign]
        writer.Recorder.flush = flush  # type: ignore[method-assign]
    return events


def apply(events: list[Any], run_dir: Path) -> tuple[int, int]:
    """CPU ns on this thread to write ``events`` into a new run, and to seal it."""
    rec = writer.Recorder(writer.RecorderConfig(run_dir=run_dir, worker="bench"))
    started = time.thread_time_ns()
    for i, event in enumerate(events):
        rec._take(event, [])
        if i % 512 == 511:  # the benchmark flushes every 512 calls
            rec._end_cycle([], force=True)
    rec._end_cycle([], force=True)
    written = time.thread_time_ns()
    rec._sink._closed = True  # no sealing thread from here on: the seals run on this thread, counted
    rec._finish_steps(all_steps=True)
    rec._sink.shutdown(60)
    return written - started, time.thread_time_ns() - written


def _callgrind(on: bool) -> None:
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1600)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--callgrind", action="store_true", help="count one round (run under callgrind)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rlreplay-bench-"))
    events = capture(tmp / "capture", args.calls)
    spans = sum(1 for e in events if e.kind == writer.SPAN and e.meta.kind == "llm")
    tree = Path(rlreplay.__file__).resolve().parent.parent
    apply(events, tmp / "warm")  # first-time costs (imports, codecs) out of the figures
    if args.callgrind:
        _callgrind(True)
        apply(events, tmp / "counted")
        _callgrind(False)
        print(
            f"{tree}: {spans} token spans counted: instructions per span = callgrind's 'Collected' / {spans}"
        )
        return
    rounds = [apply(events, tmp / f"run{k}") for k in range(args.rounds)]
    shards = sorted((tmp / "run0" / "spans").rglob("*.parquet"))
    size = sum(p.stat().st_size for p in shards)
    write = [r[0] / spans / 1e3 for r in rounds]
    seal = [r[1] / spans / 1e3 for r in rounds]
    print(
        f"{tree}: {spans} token spans, load {os.getloadavg()[0]:.1f}; CPU µs per span, median (min) of "
        f"{args.rounds}: write {statistics.median(write):.1f} ({min(write):.1f}), "
        f"seal {statistics.median(seal):.1f} ({min(seal):.1f}); shards {size:,} bytes"
    )


if __name__ == "__main__":
    main()
