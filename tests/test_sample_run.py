"""The shipped sample run: it opens, lists, nests like verl, and its token ids are the generator's texts."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import sys
from collections import Counter
from pathlib import Path

import pytest

import rlreplay
from rlreplay.cli.main import main
from rlreplay.text.conversation import turns

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "sample_runs" / "gsm8k-grpo-qwen3"
GENERATOR = ROOT / "sample_runs" / "make_sample_run.py"


def _load_generator():
    if "make_sample_run" in sys.modules:
        return sys.modules["make_sample_run"]
    spec = importlib.util.spec_from_file_location("make_sample_run", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_sample_run"] = module  # workers forked by the generator find it by name
    spec.loader.exec_module(module)
    return module


gen = _load_generator()

TRAIN_PER_STEP = gen.NUM_WORKERS * gen.SAMPLES_PER_WORKER * gen.ROLLOUT_N
VAL_PER_PASS = gen.NUM_WORKERS * gen.VAL_SAMPLES_PER_WORKER


def expected_count(step: int | None = None) -> int:
    steps = range(gen.NUM_STEPS) if step is None else [step]
    return sum(TRAIN_PER_STEP + (VAL_PER_PASS if s in gen.VAL_STEPS else 0) for s in steps)


@pytest.fixture(scope="module")
def run() -> rlreplay.Run:
    return rlreplay.open_run(RUN)


@pytest.fixture(scope="module")
def trajectories(run: rlreplay.Run) -> list[rlreplay.Trajectory]:
    rows = run.trajectories()
    return run.load(rows["id"].to_pylist())


@pytest.fixture(scope="module")
def raw_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(gen.tokenizer_dir() / "tokenizer.json"))


def test_run_opens_with_its_manifest(run: rlreplay.Run) -> None:
    assert run.manifest["experiment"] == gen.EXPERIMENT
    assert run.manifest["tokenizer"] == gen.TOKENIZER
    assert run.manifest["tokenizer_files"] == gen.TOKENIZER_FILES
    assert run.manifest["synthetic"] is True
    table = run.trajectories()
    assert table.num_rows == expected_count()
    assert set(table["worker"].to_pylist()) == set(gen.WORKER_NAMES)
    assert set(table["experiment"].to_pylist()) == {gen.EXPERIMENT}
    assert set(table["status"].to_pylist()) == {"ok"}
    assert run.warnings == []
    assert run.counters()["dropped"] == run.counters()["lost"] == 0
    size = sum(p.stat().st_size for p in RUN.rglob("*") if p.is_file())
    assert size < 3_000_000


def test_ls_step_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["ls", str(RUN), "--step", "5", "--json"])
    assert rc in (0, None)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(rows) == expected_count(5)
    assert {r["step"] for r in rows} == {5}
    # each training prompt of the step has its full GRPO group, from the worker that owns it
    groups = Counter((r["worker"], r["sample_index"]) for r in rows if not r["validate"])
    assert groups == Counter(
        {(name, s): gen.ROLLOUT_N for w, name in enumerate(gen.WORKER_NAMES) for s in gen.train_samples(5, w)}
    )


def test_validation_passes(run: rlreplay.Run) -> None:
    val = run.trajectories(validate=True).to_pylist()
    assert len(val) == VAL_PER_PASS * len(gen.VAL_STEPS)
    assert {r["step"] for r in val} == set(gen.VAL_STEPS)
    assert {r["rollout_n"] for r in val} == {0}
    for w, name in enumerate(gen.WORKER_NAMES):
        for step in gen.VAL_STEPS:
            mine = {r["sample_index"] for r in val if r["worker"] == name and r["step"] == step}
            assert mine == set(gen.val_samples(w))
    # greedy decoding in validation, sampling in training
    run_val = run.load([val[0]["id"]])[0]
    assert run_val.by_kind("llm")[0].inputs["sampling_params"]["temperature"] == 0


def test_span_tree_is_nested_like_verl(trajectories: list[rlreplay.Trajectory]) -> None:
    assert len(trajectories) == expected_count()
    for traj in trajectories:
        (root,) = traj.roots
        assert (root.name, root.kind) == ("agent_loop", "trajectory")
        (agent,) = root.children
        assert (agent.name, agent.kind) == ("ToolAgentLoop.run", "agent")
        names = {"llm": "LLMServerClient.generate", "parser": "HermesToolParser.extract_tool_calls"}
        names["tool"] = "Gsm8kTool.execute"
        for child in agent.children:
            assert child.name == names[child.kind]
            assert child.children == []
            assert agent.start_ns <= child.start_ns <= child.end_ns <= agent.end_ns
        kinds = [c.kind for c in sorted(agent.children, key=lambda s: s.start_ns)]
        # generate → parse → (tool → generate → parse)*
        assert kinds[:2] == ["llm", "parser"]
        assert kinds[2:] == ["tool", "llm", "parser"] * ((len(kinds) - 2) // 3)
        texts = gen.conversation_texts(traj.step, traj.sample_index, traj.rollout_n, traj.validate)
        assert kinds.count("llm") == sum(1 for role, _ in texts if role == "assistant")
        assert kinds.count("tool") == sum(1 for role, _ in texts if role == "tool")
        truth = gen.gsm8k()[traj.sample_index].answer
        assert agent.reward == traj.reward == gen.final_reward(texts, truth)


def test_turns_decode_to_the_generator_texts(trajectories: list[rlreplay.Trajectory], raw_tokenizer) -> None:
    rewards = Counter()
    for traj in trajectories:
        conv = turns(traj)
        texts = [raw_tokenizer.decode(t.token_ids, skip_special_tokens=False) for t in conv]
        expected = gen.conversation_texts(traj.step, traj.sample_index, traj.rollout_n, traj.validate)
        assert list(zip([t.role for t in conv], texts)) == expected, traj.id
        agent = traj.by_kind("agent")[0]
        prompt, response = agent.output["prompt_ids"], agent.output["response_ids"]
        # every model call saw the growing context: the prompt plus the response so far
        for turn, llm in zip(
            [t for t in conv if t.role == "assistant"], sorted(traj.by_kind("llm"), key=lambda s: s.start_ns)
        ):
            assert turn.span_id == llm.span_id
            assert llm.inputs["prompt_ids"] == prompt + response[: turn.start]
            assert llm.output["token_ids"] == turn.token_ids
        # the parsed tool call names the answer the tool then reports on
        for i, turn in enumerate(conv):
            if turn.role == "assistant" and i + 1 < len(conv):
                (call,) = turn.tool_calls
                assert call["name"] == gen.TOOL_NAME
                assert f"answer='{call['arguments']['answer']}'" in texts[i + 1]
            elif turn.role == "assistant":
                assert turn.tool_calls == []
        rewards[traj.reward] += 1
    # the GRPO groups are worth diffing: both outcomes occur
    assert rewards[1.0] > 0 and rewards[0.0] > 0


def test_training_improves_reward(run: rlreplay.Run) -> None:
    rows = run.trajectories(validate=False).to_pylist()
    first = [r["reward"] for r in rows if r["step"] < gen.NUM_STEPS // 2]
    last = [r["reward"] for r in rows if r["step"] >= gen.NUM_STEPS // 2]
    assert sum(last) / len(last) > sum(first) / len(first)


def test_generator_refuses_to_overwrite(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gen.main(["--out", str(RUN)])
    assert exc.value.code == 2
    assert "--force" in capsys.readouterr().err


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_generator_reproduces_the_shipped_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trajectories: list[rlreplay.Trajectory]
) -> None:
    """A one-step run from the generator (forked workers see the smaller config) matches the shipped ids."""
    monkeypatch.setattr(gen, "NUM_STEPS", 1)
    monkeypatch.setattr(gen, "VAL_STEPS", (0,))
    out = gen.generate(tmp_path / "again")
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # built aside, then renamed
    fresh = rlreplay.open_run(out)
    rows = fresh.trajectories()
    assert rows.num_rows == TRAIN_PER_STEP + VAL_PER_PASS
    shipped = {
        (t.step, t.sample_index, t.rollout_n, t.validate, t.worker): t.by_kind("agent")[0].output
        for t in trajectories
    }
    for traj in fresh.load(rows["id"].to_pylist()):
        key = (traj.step, traj.sample_index, traj.rollout_n, traj.validate, traj.worker)
        mine, theirs = traj.by_kind("agent")[0].output, shipped[key]
        for field in ("prompt_ids", "response_ids", "response_mask", "reward_score", "num_turns"):
            assert mine[field] == theirs[field], (key, field)
