"""A generic RL job recorded step by step for the watch tests (run under ``rlreplay record``).

``python watch_job.py STEPS FAULT_STEP CONTROL [SAMPLES ROLLOUTS]``: steps 0..STEPS-1 of 4 prompts x
4 rollouts (or SAMPLES x ROLLOUTS), a model call, a tool call and a second model call each. From
FAULT_STEP on, rollouts 2 and 3 of every four (half the rollouts) degenerate: their response repeats
one 4-gram and their tool raises. Each trajectory's id goes into ``CONTROL/ids-STEP.jsonl`` with
whether it is faulty. After the last step the job waits for ``CONTROL/stop`` (at most 120 s), so
that a test can see what a watcher printed while the job still ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import rlreplay

SAMPLES = 4
ROLLOUTS = 4
FAULTY_ROLLOUTS = (2, 3)


def healthy_ids(step: int, sample: int, rollout: int, turn: int) -> list[int]:
    """A response of distinct token ids (no repeated n-gram), 20-27 ids long."""
    start = 1000 + 97 * step + 31 * sample + 7 * rollout + 500 * turn
    return list(range(start, start + 20 + (rollout + sample) % 8))


def faulty_ids() -> list[int]:
    """One 4-gram repeated 16 times."""
    return [11, 12, 13, 14] * 16


class LLMServerClient:
    @rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        ids = sampling_params["ids"]
        return {"token_ids": ids, "log_probs": [-0.1] * len(ids), "stop_reason": "stop"}


class CalcTool:
    @rlreplay.trace_op(name="CalcTool.execute", kind="tool")
    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple:
        if parameters["fail"]:
            raise RuntimeError("calculator backend unavailable")
        return ({"text": "4"}, 0.0, {})


class ToolAgentLoop:
    @rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
    async def run(self, step: int, sample: int, rollout: int, faulty: bool) -> dict:
        prompt = [100 + sample, 200, 300 + sample]
        first = faulty_ids() if faulty else healthy_ids(step, sample, rollout, 0)
        await LLMServerClient().generate("r0", prompt_ids=prompt, sampling_params={"ids": first})
        with contextlib.suppress(RuntimeError):
            await CalcTool().execute("t0", {"expression": "2+2", "fail": faulty})
        observation = [900, 901]
        second = healthy_ids(step, sample, rollout, 1)[:5]
        await LLMServerClient().generate(
            "r1", prompt_ids=prompt + first + observation, sampling_params={"ids": second}
        )
        response = first + observation + second
        mask = [1] * len(first) + [0] * len(observation) + [1] * len(second)
        reward = 0.0 if faulty else float((step + sample + rollout) % 2)
        return {
            "prompt_ids": prompt,
            "response_ids": response,
            "response_mask": mask,
            "reward_score": reward,
        }


async def one(step: int, sample: int, rollout: int, faulty: bool) -> str:
    keys = {"step": step, "sample_index": sample, "rollout_n": rollout}
    async with rlreplay.trajectory(**keys, name="agent_loop") as traj:
        await ToolAgentLoop().run(step, sample, rollout, faulty)
    return traj.id


async def main(steps: int, fault_step: int, control: Path, samples: int, rollouts: int) -> None:
    for step in range(steps):
        jobs = [
            (sample, rollout, step >= fault_step and rollout % 4 in FAULTY_ROLLOUTS)
            for sample in range(samples)
            for rollout in range(rollouts)
        ]
        ids = await asyncio.gather(*(one(step, s, r, bad) for s, r, bad in jobs))
        lines = [json.dumps({"id": i, "faulty": bad}) for i, (_, _, bad) in zip(ids, jobs)]
        (control / f"ids-{step}.jsonl").write_text("\n".join(lines) + "\n")
        await asyncio.sleep(0.3)
    rlreplay.flush()
    deadline = time.monotonic() + 120
    while not (control / "stop").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[4:6]] or [SAMPLES, ROLLOUTS]
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), *sizes))
