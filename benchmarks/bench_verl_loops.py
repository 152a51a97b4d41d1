"""Non-overlapping verl agent loops, traced vs untraced: what the end of each loop costs the event loop.

Each agent loop runs alone (verl's ``rollout_trace_attr`` + a ``rollout_trace_op`` agent ``run``
making 3 ``generate`` calls of 1,000 prompt + 200 response ids), so every loop is the last open one
of its batch and triggers the recorder's end-of-batch flush. Variants, interleaved in one process:
- untraced: the same classes decorated with verl's own decorators (trace backend unset);
- rlreplay: rlreplay's verl hook; the end of a batch only signals the writer;
- rlreplay, blocking flush: the previous behaviour, ``flush(timeout=1.0)`` on the event loop.

    python benchmarks/bench_verl_loops.py [--loops 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loops", type=int, default=300, help="agent loops per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import verl.utils.rollout_trace as rt

    import rlreplay
    from rlreplay.recorders import verl as verl_hook

    def make_classes(op):
        class Client:
            @op
            async def generate(self, request_id, *, prompt_ids, sampling_params):
                await asyncio.sleep(0)
                return {"token_ids": list(range(len(prompt_ids), len(prompt_ids) + 200))}

        class Loop:
            @op
            async def run(self, sampling_params, **kwargs):
                out: list[int] = []
                for turn in range(3):
                    prompt = list(range(1000)) + out
                    res = await Client().generate(
                        f"r{turn}", prompt_ids=prompt, sampling_params=sampling_params
                    )
                    out += res["token_ids"]
                return {"response_ids": out}

        return Loop

    untraced_attr, untraced_loop = rt.rollout_trace_attr, make_classes(rt.rollout_trace_op)
    run_dir = Path(tempfile.mkdtemp(prefix="rlreplay-bench-loops-")) / "run"
    rlreplay.init(run_dir, worker="bench")
    verl_hook.install(rt)
    rt.RolloutTraceConfig.init("bench", "loops", "rlreplay")
    traced_attr, traced_loop = rt.rollout_trace_attr, make_classes(rt.rollout_trace_op)
    signal_only = verl_hook._flush_batch

    def blocking_flush() -> None:
        rlreplay.flush(timeout=1.0)

    async def loops(attr, loop_cls, n: int, step: int) -> list[float]:
        times = []
        for i in range(n):
            started = time.perf_counter()
            with attr(step=step, sample_index=i, rollout_n=0, name="agent_loop"):
                await loop_cls().run({"temperature": 1.0})
            times.append(time.perf_counter() - started)
            await asyncio.sleep(0)
        return times

    results: dict[str, list[float]] = {"untraced": [], "rlreplay": [], "rlreplay, blocking flush": []}
    for r in range(args.rounds):
        for name in results:
            verl_hook._flush_batch = blocking_flush if "blocking" in name else signal_only
            attr, loop_cls = (
                (untraced_attr, untraced_loop) if name == "untraced" else (traced_attr, traced_loop)
            )
            results[name] += asyncio.run(loops(attr, loop_cls, args.loops, r))
            rlreplay.flush()
    verl_hook._flush_batch = signal_only
    counters = rlreplay.stats()
    rlreplay.close()
    import os

    load = os.getloadavg()[0]
    print(f"python {sys.version.split()[0]}, load {load:.1f}; {args.loops} loops x {args.rounds} rounds")
    base = statistics.median(results["untraced"])
    print(f"{'variant':28s} {'median ms/loop':>15s} {'p90 ms':>8s} {'over untraced':>14s}")
    for name, times in results.items():
        med = statistics.median(times)
        p90 = sorted(times)[int(len(times) * 0.9)]
        print(f"{name:28s} {med * 1e3:15.3f} {p90 * 1e3:8.3f} {(med - base) * 1e3:+13.3f}ms")
    print(f"recorded {counters['spans']} spans, lost {counters['lost']}, spilled {counters['spilled']}")


if __name__ == "__main__":
    main()
