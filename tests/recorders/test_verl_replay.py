"""Replaying a step of verl's real AgentLoopWorker (CPU, tool agent loop) with no model server.

The recorded run's ``generate_sequences`` DataProto is saved by the job itself
(``verl_scripts/replay_agent_loop.py``); the replayed job's must equal it tensor by tensor and in
``non_tensor_batch``, while no model call reaches the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from support import rlreplay_proc

SCRIPT = Path(__file__).parents[1] / "verl_scripts" / "replay_agent_loop.py"
#: rlreplay's own key in ``non_tensor_batch``: names the trajectory in its own run.
OWN_KEY = "rlreplay_trajectory"


rlreplay = partial(rlreplay_proc, timeout=400)


def job(workdir: Path, out: Path) -> list[str]:
    workdir.mkdir()
    return [sys.executable, str(SCRIPT), str(workdir), str(out)]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("verl-replay")
    proc = rlreplay("record", "--out", str(base / "src"), "--", *job(base / "w", base / "src.pt"), cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base


def same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.shape == b.shape
            and all(same(x, y) for x, y in zip(a.tolist(), b.tolist()))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def check_equal_batches(recorded: Path, replayed: Path) -> None:
    a = torch.load(recorded, weights_only=False)
    b = torch.load(replayed, weights_only=False)
    assert a["batch"].keys() == b["batch"].keys()
    for name in (
        "prompts",
        "responses",
        "response_mask",
        "attention_mask",
        "position_ids",
        "rollout_log_probs",
    ):
        assert name in a["batch"]
    for name, tensor in a["batch"].items():
        assert tensor.dtype == b["batch"][name].dtype, name
        assert torch.equal(tensor, b["batch"][name]), name
    assert a["non_tensor_batch"].keys() == b["non_tensor_batch"].keys()
    for name, values in a["non_tensor_batch"].items():
        if name == OWN_KEY:  # the same keys; each run names its own trajectory ids
            keys = ("step", "sample_index", "rollout_n", "validate")
            assert [[d[k] for k in keys] for d in values] == [
                [d[k] for k in keys] for d in b["non_tensor_batch"][name]
            ]
            continue
        assert same(values, b["non_tensor_batch"][name]), name
    assert len(a["non_tensor_batch"]["__num_turns__"]) == 4


def replay(source: Path, tmp_path: Path, serve: str) -> subprocess.CompletedProcess:
    log = tmp_path / "engine.log"
    env = {"VERL_PARTS_ENGINE_DOWN": "1", "VERL_PARTS_ENGINE_LOG": str(log)}
    args = ("replay", str(source / "src"), "--serve", serve, "--out", str(tmp_path / "new"), "--")
    proc = rlreplay(*args, *job(tmp_path / "w", tmp_path / "new.pt"), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not log.exists()  # no generate reached the engine
    return proc


def listing(run: Path) -> list[dict]:
    proc = rlreplay("ls", str(run), "--json", cwd=run.parent)
    return [json.loads(line) for line in proc.stdout.splitlines()]


def check_equal_driver(source: Path, tmp_path: Path) -> None:
    """The driver's rewards and GRPO advantages of the replayed step are the recorded run's: in the
    job's own tensors, and in both runs' signals; the recorded ones as computed here from the source
    run's agent-loop outputs (each rollout's model tokens) by GRPO's rule."""
    import rlreplay

    a = torch.load(source / "src.pt", weights_only=False)
    b = torch.load(tmp_path / "new.pt", weights_only=False)
    assert torch.equal(a["advantages"], b["advantages"])
    signals = {}
    for run in (source / "src", tmp_path / "new"):
        rows = listing(run)
        signals[run] = {
            (r["step"], r["sample_index"], r["rollout_n"]): (r["reward"], r["advantage"]) for r in rows
        }
    recorded, replayed = signals.values()
    assert recorded == replayed and len(recorded) == 4
    run = rlreplay.open_run(source / "src")
    expected_reward = {}
    for row in listing(source / "src"):
        agent = next(s for s in run.trajectory(row["id"]).spans if s.kind == "agent")
        model_tokens = sum(agent.output["response_mask"])
        reward = ((model_tokens + row["rollout_n"] + 1) % 3) / 2  # the job's driver_reward
        expected_reward[(row["step"], row["sample_index"], row["rollout_n"])] = reward
    assert {k: r for k, (r, _) in recorded.items()} == expected_reward
    assert any(advantage != 0 for _, advantage in recorded.values())
    for keys, (reward, advantage) in recorded.items():
        group = [r for k, r in expected_reward.items() if k[:2] == keys[:2]]
        mean = sum(group) / len(group)
        std = (sum((r - mean) ** 2 for r in group) / (len(group) - 1)) ** 0.5
        assert advantage == pytest.approx((reward - mean) / (std + 1e-6), rel=1e-5, abs=1e-6)


def test_the_recorded_agent_loop_output_is_what_run_returned(source: Path) -> None:
    """verl's post-processing adds ``raw_prompt`` (and rlreplay its key) to the ``AgentLoopOutput``
    that ``run`` returned, and its reward loop sets ``reward_score``, in place. Recorded after that,
    a served agent loop would carry them, and verl would skip computing the reward of a replay."""
    import rlreplay

    run = rlreplay.open_run(source / "src")
    rows = listing(source / "src")
    assert len(rows) == 4
    for row in rows:
        traj = run.trajectory(row["id"])
        [agent] = [s for s in traj.spans if s.kind == "agent"]
        extra = agent.output["extra_fields"]
        assert "raw_prompt" not in extra and OWN_KEY not in extra, sorted(extra)
        assert agent.output["reward_score"] is None
        model_ids = [i for s in traj.spans if s.kind == "llm" for i in s.output["token_ids"]]
        response = agent.output["response_ids"]
        assert [t for t, m in zip(response, agent.output["response_mask"]) if m] == model_ids


def test_the_run_names_verl_and_records_the_type_of_what_each_op_returned(source: Path) -> None:
    """Recorded without ``--framework``: the job traced through verl, so the run is verl's; each
    output's type record names verl's own classes, which the verl adapter rebuilds (and only them)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    from verl.tools.schemas import ToolResponse
    from verl.workers.rollout.replica import TokenOutput

    import rlreplay

    def name(cls: type) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"

    run = rlreplay.open_run(source / "src")
    assert run.manifest["framework"] == "verl"
    kinds = set()
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        for span in traj.spans:
            kinds.add(span.kind)
            if span.kind == "llm":
                assert span.output_type == {"": name(TokenOutput)}
            elif span.kind == "agent":
                assert span.output_type[""] == name(AgentLoopOutput)
            elif span.kind == "tool":
                assert span.output_type == {"": "builtins.tuple", "/0": name(ToolResponse)}
    assert {"llm", "agent", "tool"} <= kinds


def test_serve_llm_gives_the_recorded_batch_without_a_model_server(source: Path, tmp_path: Path) -> None:
    proc = replay(source, tmp_path, "llm")
    check_equal_batches(source / "src.pt", tmp_path / "new.pt")
    check_equal_driver(source, tmp_path)
    recorded = {(r["step"], r["sample_index"], r["rollout_n"]): r for r in listing(source / "src")}
    calls = sum(r["model_calls"] for r in recorded.values())
    assert f"{calls} ops served; 0 trajectories diverged" in proc.stderr
    rows = listing(tmp_path / "new")
    assert len(rows) == len(recorded) == 4
    for row in rows:
        key = (row["step"], row["sample_index"], row["rollout_n"])
        assert (row["replay"], row["replay_of"]) == ("served", recorded[key]["id"])
        assert row["model_calls"] == recorded[key]["model_calls"]


def test_serve_llm_and_tool_serves_every_tool_call_of_verl(source: Path, tmp_path: Path) -> None:
    """A verl tool call's recorded inputs hold the agent state's timing ``metrics`` (fresh on every
    run, a volatile key of the verl adapter): they are not compared, so every tool call is served."""
    import rlreplay as api

    proc = replay(source, tmp_path, "llm,tool")
    check_equal_batches(source / "src.pt", tmp_path / "new.pt")
    run = api.open_run(source / "src")
    recorded = {(r["step"], r["sample_index"], r["rollout_n"]): r for r in listing(source / "src")}
    tools = {k: sum(s.kind == "tool" for s in run.trajectory(r["id"]).spans) for k, r in recorded.items()}
    assert sum(tools.values()) > 0  # the source run called tools
    calls = sum(r["model_calls"] for r in recorded.values()) + sum(tools.values())
    assert f"{calls} ops served; 0 trajectories diverged" in proc.stderr
    new = api.open_run(tmp_path / "new")
    for row in listing(tmp_path / "new"):
        assert row["replay"] == "served"
        served = [s for s in new.trajectory(row["id"]).spans if s.kind == "tool"]
        assert len(served) == tools[row["step"], row["sample_index"], row["rollout_n"]]
        assert all(s.attributes == {"replay": "served"} for s in served)


def test_serve_agent_gives_the_recorded_batch(source: Path, tmp_path: Path) -> None:
    proc = replay(source, tmp_path, "agent")
    check_equal_batches(source / "src.pt", tmp_path / "new.pt")
    check_equal_driver(source, tmp_path)
    assert "4 ops served" in proc.stderr  # one agent loop per trajectory; nothing inside it ran
    rows = listing(tmp_path / "new")
    assert [r["model_calls"] for r in rows] == [0, 0, 0, 0]
    assert {r["replay"] for r in rows} == {"served"}


def test_a_changed_tool_parser_shows_in_compare_exactly_where_its_parse_changed(
    source: Path, tmp_path: Path
) -> None:
    import rlreplay as api

    # the new parser only takes calls whose expression starts with "10*"
    pattern = r'<tool_call>(\s*\{"name": "calculator", "arguments": \{"expression": "10\*.*?)</tool_call>'
    env = {"VERL_PARTS_TOOL_CALL_REGEX": pattern}
    args = ("replay", str(source / "src"), "--serve", "llm", "--out", str(tmp_path / "new"), "--")
    proc = rlreplay(*args, *job(tmp_path / "w", tmp_path / "new.pt"), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = api.open_run(source / "src")
    expected = set()
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        for span in traj.spans:
            if span.kind == "parser":
                calls = span.output[1]
                if any(not json.loads(c["arguments"])["expression"].startswith("10*") for c in calls):
                    expected.add((traj.step, traj.sample_index, traj.rollout_n))
    assert expected  # the source run has calls the new parser refuses
    proc = rlreplay("compare", str(source / "src"), str(tmp_path / "new"), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    changed = {(r["step"], r["sample_index"], r["rollout_n"]) for r in rows if not r["same"]}
    assert changed == expected
    assert len(rows) == 4 and all(r["a"] and r["b"] for r in rows)
    for r in rows:
        if not r["same"]:
            assert r["first_difference"]["name"] == "HermesToolParser.extract_tool_calls"
            assert r["first_difference"]["field"] == "output"
