"""A run with planted trainer-vs-rollout gaps, recorded with the real recorder through the generic
API, the way the README tells a user to record the trainer's per-token log-probs: an agent span
whose output holds ``response_ids``, ``response_mask`` and ``response_logprobs`` (its model calls'
log-probs, 0 for tool tokens, as verl does), and ``record_signals(..., output={"old_log_probs":
[...]})`` with one trainer log-prob per response token.

Four training steps of 8 prompts × 2 rollouts over two workers, and a validation step without
trainer log-probs. Steps 0 and 1 are healthy (the trainer differs by ~0.01) but for one token each;
step 2 has a few tokens far off; in step 3 every model token is ~0.9 off (broken). Model turns are
long enough (≥ 64 tokens) for the agent's log-probs to be stored as stretches of its model calls'.
Responses record per-token entropy and a weights version (``extra_fields.max_global_steps``,
stale by one on odd rollouts).

    python tests/mismatch_runs.py OUT_DIR
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import numpy as np

STEPS = 4
SAMPLES = 8
ROLLOUTS = 2


def _f32(values: list[float]) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=np.float32)]


def record_planted(run_dir: Path) -> Path:
    """Record the run into ``run_dir`` (in a child process: the recorder is per process)."""
    import subprocess

    subprocess.run([sys.executable, __file__, str(run_dir)], check=True, timeout=300)
    return run_dir


def _record(run_dir: Path) -> None:
    import rlreplay
    from rlreplay.recorder.signals import record_signals

    @rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
    async def generate(prompt_ids: list[int], rng: random.Random) -> dict:
        n = rng.randrange(64, 110)
        return {
            "token_ids": [rng.randrange(10, 4000) for _ in range(n)],
            "log_probs": _f32([-rng.expovariate(2.0) for _ in range(n)]),
        }

    @rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
    async def agent(step: int, rollout_n: int, rng: random.Random) -> dict:
        prompt = [1, 2, 3, rng.randrange(10, 4000)]
        first = await generate(prompt, rng)
        tool = [rng.randrange(10, 4000) for _ in range(rng.randrange(8, 20))]
        second = await generate(prompt + first["token_ids"] + tool, rng)
        ids = first["token_ids"] + tool + second["token_ids"]
        mask = [1] * len(first["token_ids"]) + [0] * len(tool) + [1] * len(second["token_ids"])
        version = step - (rollout_n % 2)
        return {
            "prompt_ids": prompt,
            "response_ids": ids,
            "response_mask": mask,
            "response_logprobs": first["log_probs"] + [0.0] * len(tool) + second["log_probs"],
            "entropy": _f32([rng.uniform(0.0, 5.0) for _ in ids]),
            "extra_fields": {"max_global_steps": version, "min_global_steps": version},
        }

    async def rollout(step: int, sample: int, n: int, validate: bool) -> None:
        rng = random.Random(f"{step}/{sample}/{n}/{validate}")
        async with rlreplay.trajectory(
            step=step, sample_index=sample, rollout_n=n, validate=validate
        ) as traj:
            out = await agent(step, n, rng)
        if validate:
            record_signals(traj.id, step=step, sample_index=sample, rollout_n=n, validate=True, reward=1.0)
            return
        trainer = []
        for i, (lp, m) in enumerate(zip(out["response_logprobs"], out["response_mask"])):
            if not m:
                trainer.append(rng.uniform(-9.0, -0.1))  # a tool token: the trainer scores it, never counted
            elif step == 3:
                trainer.append(lp + rng.choice((-1, 1)) * rng.uniform(0.7, 1.1))
            elif (step == 2 and i % 37 == 5) or (sample, n, i) == (3, 1, 7):
                trainer.append(lp + (3.0 if i % 2 else -2.0))
            else:
                trainer.append(lp + rng.gauss(0.0, 0.01))
        record_signals(
            traj.id,
            step=step,
            sample_index=sample,
            rollout_n=n,
            validate=False,
            reward=float(rng.random() > 0.5),
            output={"old_log_probs": _f32(trainer)},
        )

    for worker, steps in (("w0", range(0, STEPS, 2)), ("w1", range(1, STEPS, 2))):
        rlreplay.init(run_dir, worker=worker)
        for step in steps:
            for sample in range(SAMPLES):
                for n in range(ROLLOUTS):
                    asyncio.run(rollout(step, sample, n, False))
        if worker == "w1":
            for sample in range(4):
                asyncio.run(rollout(STEPS - 1, 100 + sample, 0, True))
        rlreplay.close()


if __name__ == "__main__":
    _record(Path(sys.argv[1]))
