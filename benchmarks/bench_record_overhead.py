"""Wall-time overhead of `rlreplay record` on verl's real agent loop (the verl-toolagent-smollm2 job).

    .venv/bin/python benchmarks/bench_record_overhead.py [--pairs 3] [--steps 1 --questions 2 --n 2]

Runs the same job (sample_runs/make_verl_run.py --job: verl's AgentLoopWorker + ToolAgentLoop
with SmolLM2-135M on CPU, seeded so both arms generate the same tokens) alternately without
and with `rlreplay record`, and prints per arm the median of: the whole process wall time,
the job's own rollout time (``generate_sequences`` calls, where the hook works) and the CPU
time of all its processes (user + sys, including the `rlreplay record` parent). Then,
in this process, the cost per call of a verl-decorated async method with verl's decorator
alone (backend unset) and with rlreplay's hook recording it.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "sample_runs" / "make_verl_run.py"


def run_arm(recorded: bool, job_args: list[str], scratch: Path, i: int) -> tuple[float, float, float]:
    command = [sys.executable, str(JOB), "--job", *job_args, f"--workdir={scratch / 'work'}"]
    if recorded:
        out = scratch / f"run-{i}"
        command = [sys.executable, "-m", "rlreplay", "record", "--out", str(out), "--", *command]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode != 0:
        sys.exit(f"job failed ({'recorded' if recorded else 'plain'}):\n{proc.stderr[-3000:]}")
    match = re.search(r"JOB .*rollout_s=([\d.]+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    if recorded:
        assert (scratch / f"run-{i}" / "spans").is_dir(), "nothing was recorded"
    return wall, float(match.group(1)), cpu


def per_call_costs(calls: int) -> tuple[float, float]:
    """µs per call of a decorated async method: verl's decorator only, then with rlreplay's hook."""
    import verl.utils.rollout_trace as rt

    class Plain:
        @rt.rollout_trace_op
        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
            return {"token_ids": prompt_ids[:8]}

    import rlreplay
    from rlreplay.recorders import verl as verl_hook

    run_dir = tempfile.mkdtemp(prefix="rlreplay-bench-")
    rlreplay.init(run_dir)
    verl_hook.install(rt)

    class Hooked:
        @rt.rollout_trace_op
        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
            return {"token_ids": prompt_ids[:8]}

    prompt = list(range(1000))

    async def timed(obj: object) -> float:
        best = float("inf")
        for repeat in range(3):
            with rt.rollout_trace_attr(step=repeat, sample_index=0, rollout_n=0, name="agent_loop"):
                start = time.perf_counter()
                for _ in range(calls):
                    await obj.generate("r", prompt_ids=prompt, sampling_params={"temperature": 1.0})
                best = min(best, time.perf_counter() - start)
        return best / calls * 1e6

    async def both() -> tuple[float, float]:
        return await timed(Plain()), await timed(Hooked())

    costs = asyncio.run(both())
    rlreplay.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3, help="alternating (plain, recorded) repetitions")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--calls", type=int, default=2000, help="calls for the per-call measurement")
    args = parser.parse_args()
    job_args = [
        f"--steps={args.steps}",
        f"--questions={args.questions}",
        f"--n={args.n}",
        "--val-questions=0",
        f"--max-new-tokens={args.max_new_tokens}",
    ]
    scratch = Path(tempfile.mkdtemp(prefix="rlreplay-overhead-"))
    subprocess.run([sys.executable, str(JOB), "--job", *job_args, "--steps=0", f"--workdir={scratch / 'w'}"])
    results: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for recorded in order:
            wall, rollout, cpu = run_arm(recorded, job_args, scratch, i)
            results[recorded].append((wall, rollout, cpu))
            arm = "recorded" if recorded else "plain"
            print(
                f"pair {i + 1} {arm:8}: wall {wall:7.2f} s  rollout {rollout:7.2f} s  cpu {cpu:7.2f} s",
                flush=True,
            )
    shutil.rmtree(scratch, ignore_errors=True)

    print(f"\njob: {' '.join(job_args)}; {args.pairs} alternating pairs; medians")
    print(f"{'':24}{'plain':>10}{'recorded':>10}{'ratio':>8}")
    rows = (("process wall time (s)", 0), ("rollout time (s)", 1), ("process CPU time (s)", 2))
    for label, k in rows:
        plain = statistics.median(w[k] for w in results[False])
        rec = statistics.median(w[k] for w in results[True])
        print(f"{label:24}{plain:10.2f}{rec:10.2f}{rec / plain:8.3f}")
    plain_us, hooked_us = per_call_costs(args.calls)
    print(f"\nper decorated call ({args.calls} calls, 1,000 prompt ids, best of 3; the writer thread's")
    print("encoding shares the GIL, so its work is in the recorded figure)")
    print(f"{'verl decorator only':24}{plain_us:10.1f} µs")  # backend unset: verl calls through
    print(f"{'+ rlreplay hook':24}{hooked_us:10.1f} µs{hooked_us / plain_us:8.2f}x")


if __name__ == "__main__":
    main()
