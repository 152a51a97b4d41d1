"""verl's real AgentLoopWorker on a batch whose rollouts of one prompt share their ``extra_info`` dict.

usage: python replay_shared_extra_info.py WORKDIR

The batch is built as ``RayPPOTrainer.fit`` builds it: one row per prompt, then
``DataProto.repeat(interleave=True)``, which puts the same ``extra_info`` object in every rollout of a
prompt. The reward handle adds to ``extra_info`` in place, as verl's reward managers do
(``extra_info.update(tool_extra_fields)``, ``extra_info["num_turns"] = ...``). Prints how many
calls reached the engine.
"""

from __future__ import annotations

import asyncio
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class _Remote:
    def __init__(self, fn) -> None:
        self.remote = fn  # awaited like a Ray ObjectRef


class RewardHandle:
    """A reward worker in this process, called as verl calls its Ray actor handle."""

    def __init__(self, fn) -> None:
        self.compute_score = _Remote(fn)


def main() -> None:
    workdir = sys.argv[1]
    sys.path.insert(0, HERE)
    import numpy as np
    import verl_parts
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    model_dir = verl_parts.make_model_dir(os.path.join(workdir, "model"))
    tools = verl_parts.write_tool_yaml(os.path.join(workdir, "tools.yaml"))
    config = verl_parts.build_config(model_dir, tools, backend="rlreplay")
    client = verl_parts.ScriptedLLMClient(config, model_dir)
    calls = []
    generate = verl_parts.ScriptedServer._generate

    async def counted(self, **kwargs):
        calls.append(1)
        return await generate(self, **kwargs)

    verl_parts.ScriptedServer._generate = counted

    async def compute_score(data):  # what verl's NaiveRewardManager does to the row's extra_info
        item = data[0]
        extra_info = item.non_tensor_batch["extra_info"]
        extra_info.update(item.non_tensor_batch["tool_extra_fields"].items())
        extra_info["num_turns"] = item.non_tensor_batch["__num_turns__"]
        await asyncio.sleep(0)
        return {"reward_score": None, "reward_extra_info": {}}  # the score is left to the trainer

    worker = AgentLoopWorker(config, llm_client=client)
    worker.reward_loop_worker_handles = [RewardHandle(compute_score)]
    prompts = verl_parts.make_batch([10, 11, 12], 1, 1, False)
    prompts.non_tensor_batch["extra_info"] = np.array([{"index": i} for i in (10, 11, 12)], dtype=object)
    batch = prompts.repeat(repeat_times=3, interleave=True)

    asyncio.run(worker.generate_sequences(batch))
    print(f"ENGINE_CALLS {len(calls)}", flush=True)


if __name__ == "__main__":
    main()
