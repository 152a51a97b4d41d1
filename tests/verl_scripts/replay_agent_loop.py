"""One rollout step of verl's real AgentLoopWorker (tool agent loop, Hermes tool calls) in this process.

usage: python replay_agent_loop.py WORKDIR OUT

Runs ``AgentLoopWorker.generate_sequences`` on step 1's batch (samples 10 and 11, n=2) and saves
the DataProto it returns (tensors, non-tensor batch, meta info) to OUT with ``torch.save``.
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
    result = asyncio.run(worker.generate_sequences(verl_parts.make_batch([10, 11], 2, 1, False)))
    torch.save(
        {
            "batch": {k: v for k, v in result.batch.items()},
            "non_tensor_batch": dict(result.non_tensor_batch),
            "meta_info": dict(result.meta_info),
        },
        out,
    )
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
