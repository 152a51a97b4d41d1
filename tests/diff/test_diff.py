"""``rlreplay diff`` on runs recorded by the real recorder, with real Qwen3 token ids.

Expected divergence points are computed here straight from the recorded
``response_ids``/``response_mask`` columns, never through ``rlreplay.diff.align``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from support import qwen_tokenizer_dir
from support import run_cli as cli

import rlreplay
from rlreplay.format import manifest

SAMPLE_RUN = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"
AGENT = "ToolAgentLoop.run"
QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May. How many?"
)

# Each rollout: a list of (assistant text, tool call answer or None); a tool turn follows each call.
ROLLOUTS = {
    # 0: right first time
    0: [("In April 48, in May 48 / 2 = 24. Total 48 + 24 = 72.", "72"), ("#### 72", None)],
    # 1: same first turn, then a different last turn (diverges in turn 3)
    1: [("In April 48, in May 48 / 2 = 24. Total 48 + 24 = 72.", "72"), ("So the answer is #### 70", None)],
    # 2: goes wrong inside the first turn, then needs an extra tool round that fails
    2: [
        ("In April 48, in May 48 * 2 = 96. Total 48 + 96 = 144.", "144"),
        ("Let me check again: 48 / 2 = 24, so 72.", "72"),
        ("#### 72", None),
    ],
    # 3: the same ids as rollout 0 (a separate trajectory)
    3: [("In April 48, in May 48 / 2 = 24. Total 48 + 24 = 72.", "72"), ("#### 72", None)],
}
REWARDS = {0: 1.0, 1: 0.0, 2: 0.5, 3: 1.0}


def _tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen_tokenizer_dir() / "tokenizer.json"))


def _script(step: int, rollout: int, variant: str) -> list[tuple[str, str | None]]:
    script = list(ROLLOUTS[rollout])
    if step == 1 and rollout == 0:  # a later step answers the same sample differently
        script[0] = ("April: 48. May: half of 48 is 24. Sum: 72.", "72")
    if variant == "b" and rollout == 0:  # the second run reworded its first turn ending
        text, call = script[0]
        script[0] = (text.replace("= 72.", "= 72 clips."), call)
    return script


def _record(run_dir: Path, experiment: str, variant: str) -> None:
    tok = _tok()

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    class LLMServerClient:
        @rlreplay.trace_op(name="LLMServerClient.generate", kind="llm")
        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> dict:
            await asyncio.sleep(0.001)
            return {"token_ids": ids(sampling_params["text"]), "stop_reason": "stop"}

    class HermesToolParser:
        @rlreplay.trace_op(name="HermesToolParser.extract_tool_calls", kind="parser")
        async def extract_tool_calls(self, responses_ids: list[int], answer: str | None) -> tuple:
            calls = (
                []
                if answer is None
                else [{"name": "calc_gsm8k_reward", "arguments": json.dumps({"answer": answer})}]
            )
            return "content", calls

    class Gsm8kTool:
        @rlreplay.trace_op(name="Gsm8kTool.execute", kind="tool")
        async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple:
            if parameters["answer"] == "144":
                raise ValueError("answer out of range")
            return ({"text": f"answer={parameters['answer']}"}, 0.0, {})

    class ToolAgentLoop:
        @rlreplay.trace_op(name=AGENT, kind="agent")
        async def run(self, sampling_params: dict, **kwargs) -> dict:
            step, rollout = kwargs["step"], kwargs["rollout"]
            prompt = ids(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
            client, parser, tool = LLMServerClient(), HermesToolParser(), Gsm8kTool()
            response: list[int] = []
            mask: list[int] = []
            for text, answer in _script(step, rollout, variant):
                body = text + ("\n<tool_call>" if answer else "") + "<|im_end|>"
                out = await client.generate(
                    "req", prompt_ids=prompt + response, sampling_params={"text": body}
                )
                response += out["token_ids"]
                mask += [1] * len(out["token_ids"])
                await parser.extract_tool_calls(out["token_ids"], answer)
                if answer is None:
                    continue
                try:
                    result = (await tool.execute("inst", {"answer": answer}, agent_data={"x": 1}))[0]["text"]
                except ValueError as exc:
                    result = f"error: {exc}"
                observation = ids(f"\n<|im_start|>user\n<tool_response>{result}</tool_response><|im_end|>\n")
                observation += ids("<|im_start|>assistant\n")
                response += observation
                mask += [0] * len(observation)
            return {
                "prompt_ids": prompt,
                "response_ids": response,
                "response_mask": mask,
                "reward_score": REWARDS[rollout],
                "num_turns": 2 * len(_script(step, rollout, variant)),
            }

    rlreplay.init(run_dir, experiment=experiment, worker="agent_loop_worker_0")

    async def one(step: int, sample: int, rollout: int, validate: bool) -> None:
        async with rlreplay.trajectory(
            step=step, sample_index=sample, rollout_n=rollout, validate=validate, name="agent_loop"
        ):
            await ToolAgentLoop().run({"temperature": 1.0}, step=step, rollout=rollout)

    async def go() -> None:
        for step in (0, 1):
            await asyncio.gather(*(one(step, 7, n, False) for n in ROLLOUTS))
            await asyncio.gather(*(one(step, 8, n, False) for n in (0, 1)))
        await one(1, 7, 0, True)  # a validation rollout with the same keys as a training one

    asyncio.run(go())
    rlreplay.close()
    manifest.update_manifest(run_dir, tokenizer=str(qwen_tokenizer_dir()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("diff")
    _record(base / "run-a", "exp-a", "a")
    _record(base / "run-b", "exp-b", "b")
    return base / "run-a", base / "run-b"


# ---- helpers computed straight from the recorded columns ----------------------------------------


def raw_agent_output(run_dir: Path, traj_id: str) -> dict:
    (span,) = [s for s in rlreplay.open_run(run_dir).trajectory(traj_id).spans if s.name == AGENT]
    return span.output


def expected_divergence(out_a: dict, out_b: dict) -> dict | None:
    """First differing id, its turn (mask runs; the prompt is turn 0) and offset in that turn."""
    pa_, pb = out_a["prompt_ids"], out_b["prompt_ids"]
    k = 0
    while k < min(len(pa_), len(pb)) and pa_[k] == pb[k]:
        k += 1
    if k < max(len(pa_), len(pb)):
        return {"turn": 0, "token_offset": k, "response_offset": None}
    ra, rb = out_a["response_ids"], out_b["response_ids"]
    k = 0
    while k < min(len(ra), len(rb)) and ra[k] == rb[k]:
        k += 1
    if k == len(ra) == len(rb):
        return None
    mask = out_a["response_mask"] if k < len(ra) else out_b["response_mask"]
    turn, start = 1, 0
    for i in range(1, k + 1):
        if i < len(mask) and mask[i] != mask[i - 1] and i <= k:
            turn, start = turn + 1, i
    return {"turn": turn, "token_offset": k - start, "response_offset": k}


def ids_of(run_dir: Path, **keys) -> str:
    rows = rlreplay.open_run(run_dir).trajectories(**keys).to_pylist()
    assert len(rows) == 1, rows
    return rows[0]["id"]


def diff_json(capsys: pytest.CaptureFixture[str], *args: object) -> dict:
    rc, out, err = cli(capsys, "diff", *args, "--json")
    assert rc == 0, err
    return json.loads(out)


def _subset(got: dict, expected: dict) -> dict:
    return {k: got[k] for k in expected}


# ---- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("other", [1, 2])
def test_first_divergence_matches_the_recorded_ids(runs, capsys, other: int) -> None:
    run_a, _ = runs
    id_a = ids_of(run_a, step=0, sample_index=7, rollout_n=0, validate=False)
    id_b = ids_of(run_a, step=0, sample_index=7, rollout_n=other, validate=False)
    expected = expected_divergence(raw_agent_output(run_a, id_a), raw_agent_output(run_a, id_b))
    assert expected is not None and expected["response_offset"] is not None
    got = diff_json(capsys, id_a[:10], id_b[:10], "--run", run_a, "--no-text")
    assert _subset(got["first_divergence"], expected) == expected
    assert got["identical"] is False
    # the aligned pair at that turn is the first one that is not equal, and it differs at that token
    first_changed = next(t for t in got["turns"] if t["status"] != "equal")
    assert first_changed["index_a"] == expected["turn"]
    assert first_changed["first_diff"] == expected["token_offset"]
    assert all(
        t["status"] == "equal"
        for t in got["turns"]
        if t["index_a"] is not None and t["index_a"] < expected["turn"]
    )


def test_token_level_diff_reconstructs_both_turns(runs, capsys) -> None:
    run_a, _ = runs
    got = diff_json(
        capsys, "step=0,sample_index=7,rollout_n=0,validate=false", "rollout_n=2", "--run", run_a, "--no-text"
    )
    out_a = raw_agent_output(run_a, got["a"]["id"])
    out_b = raw_agent_output(run_a, got["b"]["id"])
    assert got["text"] is False
    for turn in got["turns"]:
        if turn["status"] == "equal":
            continue
        # joining "equal"+"a" pieces gives A's ids for that turn, "equal"+"b" pieces B's
        rebuilt_a = [i for seg in turn["diff"] for i in (seg["value"] if seg["op"] == "equal" else seg["a"])]
        rebuilt_b = [i for seg in turn["diff"] for i in (seg["value"] if seg["op"] == "equal" else seg["b"])]
        if turn["index_a"] is not None and turn["role"] != "prompt":
            start = turn["start_a"]
            assert rebuilt_a == out_a["response_ids"][start : start + turn["tokens_a"]]
        else:
            assert rebuilt_a == []
        if turn["index_b"] is not None and turn["role"] != "prompt":
            start = turn["start_b"]
            assert rebuilt_b == out_b["response_ids"][start : start + turn["tokens_b"]]
        else:
            assert rebuilt_b == []
    # rollout 2 has one more model call and one more tool call, and its one tool error
    assert got["b"]["model_calls"] - got["a"]["model_calls"] == 1
    assert got["deltas"]["tool_calls"] == 1
    assert got["b"]["tool_errors"] == 1 and got["a"]["tool_errors"] == 0
    assert got["deltas"]["response_tokens"] == len(out_b["response_ids"]) - len(out_a["response_ids"])
    assert got["deltas"]["reward"] == REWARDS[2] - REWARDS[0]
    statuses = [t["status"] for t in got["tools"]]
    assert statuses[0] == "changed" and got["tools"][0]["b"]["error"].endswith("answer out of range")
    assert statuses[-1] == "only_b"


def test_word_level_diff_with_the_run_tokenizer(runs, capsys) -> None:
    run_a, _ = runs
    got = diff_json(capsys, "step=0,sample_index=7,rollout_n=0,validate=false", "rollout_n=1", "--run", run_a)
    assert got["text"] is True
    changed = [t for t in got["turns"] if t["status"] == "changed"]
    assert len(changed) == 1 and changed[0]["unit"] == "words"
    pieces = changed[0]["diff"]
    text_a = "".join(s["value"] if s["op"] == "equal" else s["a"] for s in pieces)
    text_b = "".join(s["value"] if s["op"] == "equal" else s["b"] for s in pieces)
    assert text_a == "#### 72<|im_end|>"
    assert text_b == "So the answer is #### 70<|im_end|>"
    assert any(s["op"] == "change" and "70" in s["b"] and "72" in s["a"] for s in pieces)
    assert any(s["op"] == "equal" and "####" in s["value"] for s in pieces)


def test_self_diff_reports_nothing(runs, capsys) -> None:
    run_a, _ = runs
    traj = ids_of(run_a, step=1, sample_index=7, rollout_n=2, validate=False)
    got = diff_json(capsys, traj, traj, "--run", run_a)
    assert got["identical"] is True
    assert got["first_divergence"] is None
    assert {t["status"] for t in got["turns"]} == {"equal"}
    assert all(v in (0, 0.0) for v in got["deltas"].values())
    rc, out, _ = cli(capsys, "diff", traj, traj, "--run", run_a)
    assert rc == 0 and "no differences" in out and "[-" not in out and "{+" not in out


def test_same_ids_in_two_trajectories_is_no_divergence(runs, capsys) -> None:
    run_a, _ = runs
    got = diff_json(capsys, "step=0,sample_index=7,rollout_n=0,validate=false", "rollout_n=3", "--run", run_a)
    assert got["a"]["id"] != got["b"]["id"]
    assert got["first_divergence"] is None and got["identical"] is True


def test_selector_across_steps_inherits_the_other_keys(runs, capsys) -> None:
    run_a, _ = runs
    got = diff_json(
        capsys, "step=0,sample_index=7,rollout_n=0,validate=false", "step=1", "--run", run_a, "--no-text"
    )
    assert (got["a"]["step"], got["b"]["step"]) == (0, 1)
    for key in ("sample_index", "rollout_n", "validate", "experiment"):
        assert got["a"][key] == got["b"][key]
    id_a = ids_of(run_a, step=0, sample_index=7, rollout_n=0, validate=False)
    id_b = ids_of(run_a, step=1, sample_index=7, rollout_n=0, validate=False)
    assert (got["a"]["id"], got["b"]["id"]) == (id_a, id_b)
    expected = expected_divergence(raw_agent_output(run_a, id_a), raw_agent_output(run_a, id_b))
    assert _subset(got["first_divergence"], expected) == expected
    # A given by id prefix: B's selector inherits from that trajectory
    by_id = diff_json(capsys, id_a[:8], "step=1", "--run", run_a, "--no-text")
    assert (by_id["a"]["id"], by_id["b"]["id"]) == (id_a, id_b)


def test_selector_across_two_runs(runs, capsys) -> None:
    run_a, run_b = runs
    sel = "step=0,sample_index=7,rollout_n=0,validate=false"
    got = diff_json(capsys, sel, "--run", run_a, "--run-b", run_b, "--no-text")  # B: the same keys in run B
    assert (got["a"]["experiment"], got["b"]["experiment"]) == ("exp-a", "exp-b")
    assert got["a"]["run"] != got["b"]["run"]
    id_a = ids_of(run_a, step=0, sample_index=7, rollout_n=0, validate=False)
    id_b = ids_of(run_b, step=0, sample_index=7, rollout_n=0, validate=False)
    assert got["b"]["id"] == id_b
    expected = expected_divergence(raw_agent_output(run_a, id_a), raw_agent_output(run_b, id_b))
    assert expected is not None
    assert _subset(got["first_divergence"], expected) == expected
    # and an explicit partial selector for B in the other run
    got2 = diff_json(capsys, sel, "rollout_n=1", "--run", run_a, "--run-b", run_b, "--no-text")
    assert got2["b"]["id"] == ids_of(run_b, step=0, sample_index=7, rollout_n=1, validate=False)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["step=0,sample_index=7", "rollout_n=1"], "matches 4 trajectories"),  # >1: rollouts differ
        (["step=1,sample_index=7,rollout_n=0", "rollout_n=1"], "add validate"),  # train and validation
        (["step=0,sample_index=99,rollout_n=0", "rollout_n=1"], "no sample_index=99"),
        (["step=5,sample_index=7,rollout_n=0", "rollout_n=1"], "no step=5"),
        (["step=zero,sample_index=7", "rollout_n=1"], "step 'zero': 'zero' is not an integer"),
        (["step=٣,sample_index=7", "rollout_n=1"], "step '٣': '٣' has non-ASCII digits"),
        (["sample_index=7..x", "rollout_n=1"], "bad range '7..x'"),  # the grammar of --sample-index
        (["step=0,colour=red", "rollout_n=1"], "unknown key 'colour'"),
        (["step=0,,rollout_n=1", "rollout_n=1"], "empty item"),
        (["step=0,validate=maybe", "rollout_n=1"], "validate must be true or false"),
        (["step=0,step=1", "rollout_n=1"], "given twice"),
        (["not-an-id", "rollout_n=1"], "neither a trajectory id"),
        (["ffffffffff", "rollout_n=1"], "no trajectory 'ffffffffff'"),
        (["step=0,sample_index=7,rollout_n=0,validate=false", "rollout_n=9"], "no rollout_n=9"),
        (["step=0,sample_index=7,rollout_n=0,validate=false"], "give trajectory B"),
    ],
)
def test_bad_selectors_are_one_line_and_exit_2(runs, capsys, args: list[str], needle: str) -> None:
    run_a, _ = runs
    rc, out, err = cli(capsys, "diff", *args, "--run", run_a)
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlreplay: error: "), err
    assert needle in lines[0]


def test_bad_selector_as_a_subprocess_has_no_traceback(runs) -> None:
    run_a, _ = runs
    proc = subprocess.run(
        [sys.executable, "-m", "rlreplay", "diff", "step=５", "rollout_n=1", "--run", str(run_a)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "rlreplay: error: selector 'step=５': step '５': '５' has non-ASCII digits "
        "(write numbers with 0-9)"
    )


def test_terminal_rendering_marks_changes_without_colour(runs, capsys, monkeypatch) -> None:
    run_a, _ = runs
    monkeypatch.setenv("NO_COLOR", "1")
    sel = "step=0,sample_index=7,rollout_n=0,validate=false"
    rc, out, err = cli(capsys, "diff", sel, "rollout_n=1", "--run", run_a)
    assert rc == 0, err
    assert "\x1b[" not in out
    assert "first divergence: turn 3 (assistant)" in out
    # the changed words of turn 3 are marked: 72 deleted, 70 inserted
    assert "[-72" in out and "70+}" in out
    rc, side, _ = cli(capsys, "diff", sel, "rollout_n=1", "--run", run_a, "--side-by-side")
    assert rc == 0 and "\x1b[" not in side
    lines = side.splitlines()
    turn_line = next(i for i, line in enumerate(lines) if line.startswith("~ turn 3 assistant"))
    assert lines[turn_line + 1].split() == ["A", "B"]  # the two columns' header
    row = lines[turn_line + 2]
    assert row.index("[-") < row.index("{+")  # A's deletion on the left, B's insertion on the right
    rc, ids_out, _ = cli(capsys, "diff", sel, "rollout_n=1", "--run", run_a, "--no-text")
    assert rc == 0 and "compared as token ids" in ids_out
    # token ids are printed, not text: the changed ids appear as numbers
    got = diff_json(capsys, sel, "rollout_n=1", "--run", run_a, "--no-text")
    change = next(
        s for t in got["turns"] if t["status"] == "changed" for s in t["diff"] if s["op"] == "change"
    )
    assert "[-" + " ".join(map(str, change["a"])) + "-]" in ids_out


def test_group_compares_every_rollout_with_the_best(runs, capsys) -> None:
    run_a, _ = runs
    got = diff_json(
        capsys, "step=0,sample_index=7,rollout_n=1,validate=false", "--group", "--run", run_a, "--no-text"
    )
    members = got["rollouts"]
    assert sorted(m["rollout_n"] for m in members) == sorted(ROLLOUTS)
    best = next(m for m in members if m["best"])
    assert best["reward"] == max(REWARDS.values()) and best["rollout_n"] == 0  # ties: lowest rollout_n
    assert got["best"] == best["id"]
    best_out = raw_agent_output(run_a, best["id"])
    for m in members:
        assert m["reward"] == REWARDS[m["rollout_n"]]
        expected = expected_divergence(best_out, raw_agent_output(run_a, m["id"]))
        if expected is None:
            assert m["first_divergence"] is None
        else:
            assert _subset(m["first_divergence"], expected) == expected
            k = expected["response_offset"]
            assert m["preview"] == raw_agent_output(run_a, m["id"])["response_ids"][k : k + len(m["preview"])]
    rc, out, _ = cli(
        capsys, "diff", "step=0,sample_index=7,rollout_n=1,validate=false", "--group", "--run", run_a
    )
    assert rc == 0 and "(best)" in out and "identical" in out
    # a selector naming the sample only picks the same group
    again = diff_json(capsys, "step=0,sample_index=7,validate=false", "--group", "--run", run_a, "--no-text")
    assert again == got
    # but not one that spans two groups (train and validation at step 1)
    rc, _, err = cli(capsys, "diff", "step=1,sample_index=7", "--group", "--run", run_a)
    assert rc == 2 and "add validate" in err


def test_python_api_on_loaded_trajectories(runs) -> None:
    from rlreplay.diff.align import diff_trajectories
    from rlreplay.text.token2text import Decoder

    run = rlreplay.open_run(runs[0])
    ids = [ids_of(runs[0], step=0, sample_index=8, rollout_n=n) for n in (0, 1)]
    a, b = run.load(ids)
    result = diff_trajectories(a, b, Decoder.load(str(qwen_tokenizer_dir())), run, run)
    assert result.text and not result.identical
    as_json = orjson.loads(orjson.dumps(result.to_dict()))
    assert as_json["first_divergence"]["turn"] == result.first_divergence.turn == 3


# ---- the shipped sample run ---------------------------------------------------------------------


def _sample_pair(step: int) -> tuple[str, str, dict, dict]:
    """Two training rollouts of one sample in the sample run whose recorded response ids differ."""
    run = rlreplay.open_run(SAMPLE_RUN)
    rows = run.trajectories(step=step, validate=False).to_pylist()
    by_sample: dict[int, list[dict]] = {}
    for row in rows:
        by_sample.setdefault(row["sample_index"], []).append(row)
    for sample in sorted(by_sample):
        group = sorted(by_sample[sample], key=lambda r: r["rollout_n"])
        outs = [raw_agent_output(SAMPLE_RUN, r["id"]) for r in group[:2]]
        if len(group) >= 2 and outs[0]["response_ids"] != outs[1]["response_ids"]:
            return group[0]["id"], group[1]["id"], outs[0], outs[1]
    raise AssertionError(f"no sample at step {step} whose rollouts differ")


def test_sample_run_two_rollouts_diverge_where_their_ids_do(capsys) -> None:
    id_a, id_b, out_a, out_b = _sample_pair(step=5)
    expected = expected_divergence(out_a, out_b)
    assert expected is not None
    got = diff_json(capsys, id_a, id_b, "--run", SAMPLE_RUN, "--no-text")
    assert _subset(got["first_divergence"], expected) == expected
    assert got["a"]["response_tokens"] == len(out_a["response_ids"])
    assert got["b"]["response_tokens"] == len(out_b["response_ids"])
    # the same pair by selector gives the same answer
    sel = f"step=5,sample_index={got['a']['sample_index']},rollout_n={got['a']['rollout_n']},validate=false"
    by_sel = diff_json(capsys, sel, f"rollout_n={got['b']['rollout_n']}", "--run", SAMPLE_RUN, "--no-text")
    assert (by_sel["a"]["id"], by_sel["b"]["id"]) == (id_a, id_b)
    assert by_sel["first_divergence"] == got["first_divergence"]
    rc, out, err = cli(capsys, "diff", id_a, id_b, "--run", SAMPLE_RUN)
    assert rc == 0, err
    assert f"response token {expected['response_offset']}" in out


def test_sample_run_self_diff_and_validation_across_steps(capsys) -> None:
    run = rlreplay.open_run(SAMPLE_RUN)
    val = run.trajectories(validate=True).to_pylist()
    steps = sorted({r["step"] for r in val})
    assert len(steps) >= 2
    first = next(r for r in val if r["step"] == steps[0])
    got = diff_json(capsys, first["id"], first["id"], "--run", SAMPLE_RUN)
    assert got["identical"] is True and got["first_divergence"] is None
    sel = f"step={steps[0]},sample_index={first['sample_index']},rollout_n={first['rollout_n']},validate=true"
    got = diff_json(capsys, sel, f"step={steps[-1]}", "--run", SAMPLE_RUN, "--no-text")
    later = next(r for r in val if r["step"] == steps[-1] and r["sample_index"] == first["sample_index"])
    assert (got["a"]["id"], got["b"]["id"]) == (first["id"], later["id"])
    expected = expected_divergence(
        raw_agent_output(SAMPLE_RUN, first["id"]), raw_agent_output(SAMPLE_RUN, later["id"])
    )
    if expected is None:
        assert got["first_divergence"] is None
    else:
        assert _subset(got["first_divergence"], expected) == expected


# ---- plain data ---------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["rapidfuzz", "difflib"])
def test_diff_sequences_rebuild_both_sides(monkeypatch, engine: str) -> None:
    import random

    from rlreplay.diff import align as diffing

    if engine == "rapidfuzz":  # rlreplay[fast]: its C++ LCS keeps long diffs interactive
        assert importlib.util.find_spec("rapidfuzz") is not None, "pip install rapidfuzz"
    monkeypatch.setattr(diffing, "USE_RAPIDFUZZ", engine == "rapidfuzz")
    rng = random.Random(3)
    for _ in range(200):
        a = [rng.randrange(6) for _ in range(rng.randrange(0, 40))]
        b = list(a)
        for _ in range(rng.randrange(0, 6)):  # a few edits
            pos = rng.randrange(len(b) + 1)
            if rng.random() < 0.5 and pos < len(b):
                del b[pos : pos + rng.randrange(1, 4)]
            else:
                b[pos:pos] = [rng.randrange(9) for _ in range(rng.randrange(1, 4))]
        segments = diffing.diff_sequences(a, b)
        assert [i for s in segments for i in s.a] == a
        assert [i for s in segments for i in s.b] == b
        assert all(s.a == s.b for s in segments if s.op == "equal")
        assert all(s.a != s.b for s in segments if s.op != "equal")
        # no two changes in a row: they are merged
        assert all(not (x.op == y.op == "change") for x, y in itertools.pairwise(segments))
        if a == b:
            assert all(s.op == "equal" for s in segments)


def test_word_diff_keeps_text_and_folds_shared_spaces() -> None:
    from rlreplay.diff.align import diff_sequences, split_words

    a, b = "The answer is 72 apples.", "So the answer is 70 apples."
    segments = diff_sequences(split_words(a), split_words(b), words=True)
    assert "".join(s.a for s in segments) == a and "".join(s.b for s in segments) == b
    changes = [(s.a.strip(), s.b.strip()) for s in segments if s.op != "equal"]
    assert changes == [("The", "So the"), ("72", "70")]  # two changes; the words between stay equal


def test_first_divergence_on_plain_turns() -> None:
    from rlreplay.diff.align import first_divergence
    from rlreplay.text.conversation import Turn

    def conv(prompt: list[int], *parts: tuple[str, list[int]]) -> list[Turn]:
        out, start = [Turn("prompt", prompt)], 0
        for role, ids in parts:
            out.append(Turn(role, ids, start=start))
            start += len(ids)
        return out

    base = conv([1, 2, 3], ("assistant", [4, 5]), ("tool", [6]), ("assistant", [7, 8, 9]))
    assert first_divergence(base, base) is None
    other_prompt = conv([1, 2, 0], ("assistant", [4, 5]))
    div = first_divergence(base, other_prompt)
    assert (div.turn, div.token_offset, div.response_offset) == (0, 2, None)
    longer = conv([1, 2, 3], ("assistant", [4, 5]), ("tool", [6]), ("assistant", [7, 8, 9, 10]))
    div = first_divergence(base, longer)  # A stops: the divergence is B's next token, in B's turn 3
    assert (div.turn, div.token_offset, div.response_offset, div.ended) == (3, 3, 6, "a")
    changed = conv([1, 2, 3], ("assistant", [4, 5]), ("tool", [6]), ("assistant", [7, 0, 9]))
    div = first_divergence(base, changed)
    assert (div.turn, div.token_offset, div.response_offset, div.ended) == (3, 1, 4, None)


def test_tokenizer_missing_explicit_is_an_error_recorded_falls_back_to_ids(runs, capsys, tmp_path) -> None:
    import shutil

    run_a, _ = runs
    sel = "step=0,sample_index=7,rollout_n=0,validate=false"
    rc, out, err = cli(capsys, "diff", sel, "rollout_n=1", "--run", run_a, "--tokenizer", tmp_path / "nope")
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--tokenizer" in err
    copy = tmp_path / "run-copy"
    shutil.copytree(run_a, copy)
    manifest.update_manifest(copy, tokenizer=str(tmp_path / "gone"))
    rc, out, err = cli(capsys, "diff", sel, "rollout_n=1", "--run", copy, "--json")
    assert rc == 0
    assert "warning" in err and "showing token ids" in err
    assert json.loads(out)["text"] is False
