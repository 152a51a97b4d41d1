"""A user's Ray job on a multi-node cluster, unaware of rlreplay: one actor pinned to each node.

usage: python ray_multinode.py CLUSTER_ADDRESS STEPS SAMPLES

Each actor records SAMPLES trajectories per step with the public tracing API (recording is on in
the workers only through the job's runtime_env: rlreplay's worker_process_setup_hook). Prints
``ACTORS [{"node": ..., "host": ..., "worker": ...}, ...]`` and ``DONE``.
"""

from __future__ import annotations

import json
import os
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=1)
class Rollout:
    def run(self, step: int, samples: list[int]) -> dict:
        import rlreplay

        @rlreplay.trace_op(kind="llm", name="Model.generate")
        def generate(prompt_ids: list[int]) -> dict:
            return {"token_ids": [t + 1 for t in prompt_ids]}

        for sample in samples:
            with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=0):
                generate(list(range(sample, sample + 8)))
        from rlreplay.recorder.api import get_recorder
        from rlreplay.recorders.activate import ray_worker_name

        ctx = ray.get_runtime_context()
        return {
            "node": ctx.get_node_id(),
            "host": os.environ.get("RLREPLAY_HOST"),
            "worker": ray_worker_name(),
            "recording": get_recorder() is not None,
            "dir": os.environ.get("RLREPLAY_DIR"),
        }


def main() -> None:
    address, steps, samples = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ray.init(address=address)
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    actors = [
        Rollout.options(
            name=f"rollout-{i}", scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()
        for i, node in enumerate(nodes)
    ]
    infos: list[dict] = []
    for step in range(steps):
        infos = ray.get(
            [a.run.remote(step, [i * 100 + j for j in range(samples)]) for i, a in enumerate(actors)]
        )
    print("ACTORS " + json.dumps(infos), flush=True)
    ray.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
