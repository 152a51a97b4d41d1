"""One rollout step of verl's real AgentLoopWorker (tool agent loop, Hermes tool calls) in this process.

usage: python replay_agent_loop.py WORKDIR OUT

Runs ``AgentLoopWorker.generate_sequences`` on step 1's batch (samples 10 and 11, n=2) and saves
the DataProto it returns (tensors, non-tensor batch, meta info) to OUT with ``torch.save``. Then the
driver's part, as ``RayPPOTrainer.fit`` does it: a reward per rollout (``driver_reward`` of its
model tokens and its rollout number) as token-level scores, and verl's own ``compute_advantage`` (GRPO,
grouped by prompt); the advantages go to OUT too.
``$VERL_PARTS_ENGINE_LOG`` / ``$VERL_PARTS_ENGINE_DOWN``: see ``verl_parts.ScriptedServer``.
``$VERL_PARTS_TOOL_CALL_REGEX``: a changed Hermes parser, which finds tool calls with this regex.
"""

from __future__ import annotations

import asyncio
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    workdir, out = sys.argv[1], sys.argv[2]
    sys.path.insert(0, HERE)
    import torch
    import verl_parts
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    if os.environ.get("VERL_PARTS_TOOL_CALL_REGEX"):
        import regex
        from verl.experimental.agent_loop.tool_parser import HermesToolParser

        init = HermesToolParser.__init__

        def changed_init(self, tokenizer) -> None:
            init(self, tokenizer)
            self.tool_call_regex = regex.compile(os.environ["VERL_PARTS_TOOL_CALL_REGEX"], regex.DOTALL)

        HermesToolParser.__init__ = changed_init
    model_dir = verl_parts.make_model_dir(os.path.join(workdir, "model"))
    tools = verl_parts.write_tool_yaml(os.path.join(workdir, "tools.yaml"))
    config = verl_parts.build_config(model_dir, tools, backend="rlreplay")
    worker = AgentLoopWorker(config, llm_client=verl_parts.ScriptedLLMClient(config, model_dir))
    batch = verl_parts.make_batch([10, 11], 2, 1, False)
    result = asyncio.run(worker.generate_sequences(batch))
    saved = {
        "batch": {k: v for k, v in result.batch.items()},
        "non_tensor_batch": dict(result.non_tensor_batch),
        "meta_info": dict(result.meta_info),
    }
    saved["advantages"] = driver_step(result, batch.non_tensor_batch["index"])
    torch.save(saved, out)
    print("DONE", flush=True)


def driver_reward(model_tokens: int, rollout_n: int) -> float:
    return ((model_tokens + rollout_n + 1) % 3) / 2


def driver_step(result, index) -> object:
    """Rewards and GRPO advantages on the driver, with verl's own ``compute_advantage``."""
    import numpy as np
    import torch
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    data = result.select(deepcopy=True)
    data.non_tensor_batch["uid"] = np.array([str(i) for i in index], dtype=object)
    mask = data.batch["response_mask"]
    length = data.batch["attention_mask"][:, -mask.shape[1] :].sum(-1)
    scores = torch.zeros(mask.shape, dtype=torch.float32)
    keys = data.non_tensor_batch["rlreplay_trajectory"]  # the rollout's keys, as recorded
    for i in range(len(data)):
        scores[i, int(length[i]) - 1] = driver_reward(int(mask[i].sum()), int(keys[i]["rollout_n"]))
    data.batch["token_level_scores"] = scores
    data.batch["token_level_rewards"] = scores
    config = AlgoConfig(adv_estimator="grpo")
    data = ray_trainer.compute_advantage(data, adv_estimator="grpo", num_repeat=2, config=config)
    return data.batch["advantages"].clone()


if __name__ == "__main__":
    main()
