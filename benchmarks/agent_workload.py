"""The agent loop ``bench_scale.py`` records and ``bench_writer.py`` feeds to the writer: ~8k-token
trajectories over 2-5 model calls whose prompt grows by the previous response and a 40-token tool
observation, float32 log-probs as Python floats, an agent span repeating every turn."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np


def make_agent_loop(
    rlreplay: Any,
    pool: list[int],
    rng: random.Random,
    nprng: np.random.Generator,
    seconds_per_token: float = 0.0,
) -> Callable[[str, int, int], Awaitable[dict]]:
    """``run_loop(request_id, total_tokens, turns)``, traced with ``rlreplay.trace_op``; model calls
    sleep ``seconds_per_token`` per generated token when it is not 0."""

    def ids(n: int) -> list[int]:
        start = rng.randrange(0, len(pool) - n)
        return pool[start : start + n]

    @rlreplay.trace_op(kind="llm")
    async def generate(request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict:
        n = sampling_params["n_tokens"]
        if seconds_per_token:
            await asyncio.sleep(n * seconds_per_token)
        log_probs = (-np.abs(nprng.normal(0, 1.2, n))).astype(np.float32).tolist()
        return {"token_ids": ids(n), "log_probs": log_probs, "stop_reason": "completed"}

    @rlreplay.trace_op(kind="tool")
    async def execute(instance_id: str, parameters: dict[str, Any]) -> tuple[str, float, dict]:
        return f"result {parameters['x']}", 0.0, {}

    @rlreplay.trace_op(kind="agent")
    async def run_loop(request_id: str, total: int, turns: int) -> dict:
        prompt = ids(total // 4)
        context = list(prompt)
        mask: list[int] = []
        log_probs: list[float] = []
        per_turn = (total - len(prompt)) // turns
        for turn in range(turns):
            params = {"temperature": 1.0, "logprobs": 1, "n_tokens": per_turn - 40}
            out = await generate(request_id, prompt_ids=context, sampling_params=params)
            context = context + out["token_ids"]
            mask += [1] * len(out["token_ids"])
            log_probs += out["log_probs"]
            if turn < turns - 1:
                await execute(request_id, {"x": turn})
                context = context + ids(40)
                mask += [0] * 40
                log_probs += [0.0] * 40
        return {
            "prompt_ids": prompt,
            "response_ids": context[len(prompt) :],
            "response_mask": mask,
            "response_logprobs": log_probs,
            "reward_score": float(rng.random() < 0.5),
            "num_turns": 2 * turns,
        }

    return run_loop
