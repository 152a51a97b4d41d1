"""Trajectory benchmark: ``Trajectory.roots``, ``reward`` and ``status`` on wide trajectories.

A real trajectory of the shipped sample run (with a tool call) is widened to N spans by copying
its tool span under the agent span, as a long agentic rollout with many tool calls looks. The
old ``roots`` (a dict of all spans rebuilt for every span: quadratic) is timed beside the current
one, in the same process.

    python benchmarks/bench_trajectory.py [--spans 1000,3000,10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import rlreplay
from rlreplay.model import Span, Trajectory

SAMPLE_RUN = Path(__file__).resolve().parent.parent / "sample_runs" / "gsm8k-grpo-qwen3"


def quadratic_roots(traj: Trajectory) -> list[Span]:
    """``Trajectory.roots`` as it was: ``_by_id`` rebuilt per span."""

    def by_id() -> dict[str, Span]:
        return {s.span_id: s for s in traj.spans}

    return [s for s in traj.spans if s.parent_id is None or s.parent_id not in by_id()]


def widen(traj: Trajectory, n: int) -> Trajectory:
    tool = next(s for s in traj.spans if s.kind == "tool")
    extra = [replace(tool, span_id=f"{i:016x}", children=[]) for i in range(max(0, n - len(traj.spans)))]
    return replace(traj, spans=[*traj.spans, *extra])


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", default="1000,3000,10000")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    run = rlreplay.open_run(SAMPLE_RUN)
    base = run.trajectory(run.trajectories(step=5, sample_index=730, rollout_n=1)["id"][0].as_py())
    print("| spans | old `roots` (quadratic) | `roots` | old / new | `reward` + `status` |")
    print("|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.spans.split(",")):
        traj = widen(base, n)
        assert [s.span_id for s in quadratic_roots(traj)] == [s.span_id for s in traj.roots]
        old = best_ms(lambda t=traj: quadratic_roots(t), min(args.repeat, 2) if n > 3000 else args.repeat)
        new = best_ms(lambda t=traj: t.roots, args.repeat)
        rule = best_ms(lambda t=traj: (t.reward, t.status), args.repeat)
        print(f"| {n:,} | {old:,.1f} ms | {new:.2f} ms | {old / new:,.0f}x | {rule:.2f} ms |")


if __name__ == "__main__":
    main()
