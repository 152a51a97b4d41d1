"""A user's verl rollout job, unaware of rlreplay: real Ray actors running verl's real AgentLoopWorker.

usage: python ray_agent_loop_workers.py WORKDIR

Two actors, each with its own verl trace config (verl's RolloutTraceConfig is per process):
- "rollout-a" (named): trace.backend=rlreplay; step 1 (train, samples 10 and 11, n=2), then
  step 2: validation (samples 10 and 11, n=1) and one agent loop entered with trace=False
  although no sampling was asked for (sample 15).
- an unnamed actor: trace.backend unset, max_samples_per_step_per_worker=1; step 1 (samples
  30, 31 and 32, n=2): verl's sampling keeps the rollouts of one sample only.

The driver then does what verl's RayPPOTrainer.fit does with a step's batch: reorders it
(balance_batch), puts the reward on the last response token and calls verl's real
``compute_advantage`` (GRPO); the reward here is the row's sample index, so that a reader can
check which trajectory each driver-side figure belongs to.

The workers' PYTHONPATH comes from this job's runtime_env (it names only this folder), so
recording there can only come from Ray's worker_process_setup_hook. Prints one
``ACTOR {json}`` line per actor with its name, id and pid, and ``DONE`` at the end.
"""

from __future__ import annotations

import json
import os
import sys

import ray

HERE = os.path.dirname(os.path.abspath(__file__))


@ray.remote
class RolloutWorker:
    def __init__(self, workdir: str, backend: str | None, max_samples: int | None) -> None:
        import verl_parts
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

        self.parts = verl_parts
        model_dir = os.path.join(workdir, "model")
        config = verl_parts.build_config(
            model_dir, os.path.join(workdir, "tools.yaml"), backend=backend, max_samples=max_samples
        )
        self.worker = AgentLoopWorker(config, llm_client=verl_parts.ScriptedLLMClient(config, model_dir))

    def identity(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "name": ctx.get_actor_name() or None,
            "actor_id": ctx.get_actor_id(),
            "class": type(self).__name__,
            "pid": os.getpid(),
        }

    async def generate(self, indices: list[int], n: int, step: int, validate: bool) -> object:
        batch = self.parts.make_batch(indices, n, step, validate)
        return await self.worker.generate_sequences(batch)

    async def run_untraced(self, step: int, sample_index: int) -> int:
        """One agent loop through verl's own _run_agent_loop, entered with trace=False."""
        batch = self.parts.make_batch([sample_index], 1, step, False)
        kwargs = {k: v[0] for k, v in batch.non_tensor_batch.items()}
        trajectory = {"step": step, "sample_index": sample_index, "rollout_n": 0, "validate": False}
        sampling_params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
        output = await self.worker._run_agent_loop(sampling_params, trajectory, trace=False, **kwargs)
        return int(output.num_turns)


def train_like_fit(batch: object, n: int) -> None:
    import numpy as np
    import torch
    from verl.trainer.ppo.ray_trainer import compute_advantage

    index = batch.non_tensor_batch["index"]
    batch.non_tensor_batch["uid"] = np.array([f"uid-{i}" for i in index], dtype=object)
    batch.reorder(torch.tensor([3, 0, 2, 1]))
    mask = batch.batch["response_mask"]
    last = mask.shape[1] - 1 - torch.flip(mask, dims=[1]).argmax(-1)
    scores = torch.zeros_like(mask, dtype=torch.float32)
    scores[torch.arange(len(batch)), last] = torch.tensor([float(i) for i in batch.non_tensor_batch["index"]])
    batch.batch["token_level_scores"] = batch.batch["token_level_rewards"] = scores
    batch = compute_advantage(batch, adv_estimator="grpo", num_repeat=n)
    print("ADVANTAGES " + json.dumps(batch.batch["advantages"].sum(-1).tolist()), flush=True)


def main() -> None:
    workdir = sys.argv[1]
    sys.path.insert(0, HERE)
    import verl_parts

    verl_parts.make_model_dir(os.path.join(workdir, "model"))
    verl_parts.write_tool_yaml(os.path.join(workdir, "tools.yaml"))

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": HERE}},
    )
    a = RolloutWorker.options(name="rollout-a").remote(workdir, "rlreplay", None)
    b = RolloutWorker.remote(workdir, None, 1)
    for actor in (a, b):
        print("ACTOR " + json.dumps(ray.get(actor.identity.remote())), flush=True)

    out_a, _ = ray.get(
        [a.generate.remote([10, 11], 2, 1, False), b.generate.remote([30, 31, 32], 2, 1, False)]
    )
    train_like_fit(out_a, n=2)
    ray.get([a.generate.remote([10, 11], 1, 2, True), a.run_untraced.remote(2, 15)])
    ray.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
