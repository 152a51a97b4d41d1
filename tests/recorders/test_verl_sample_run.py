"""The shipped real-verl sample run: rewards, advantages, differing rollouts, text on a fresh checkout."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from support import json_rows, rlreplay_proc

import rlreplay
from rlreplay.format import payload

RUN = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-toolagent-smollm2"
FIGURES = ("reward", "advantage", "logprob_diff_mean", "logprob_diff_max", "importance_ratio")


@pytest.fixture(scope="module")
def run() -> rlreplay.Run:
    return rlreplay.open_run(RUN)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return json_rows("ls", RUN, "--json")


@pytest.fixture(scope="module")
def signals(run: rlreplay.Run) -> dict[str, dict]:
    """trajectory id → its signals figures (columns when the schema has them, else attributes)."""
    out = {}
    for row in run.spans().to_pylist():
        if row["kind"] != "signals":
            continue
        figures = dict(payload.decode(row["attributes"]) or {})
        figures.update({k: row[k] for k in FIGURES if row.get(k) is not None})
        out[row["trajectory_id"]] = figures
    return out


def test_manifest_names_the_framework_and_the_tokenizer_the_run_holds(run: rlreplay.Run) -> None:
    assert run.manifest["framework"] == "verl"
    assert run.manifest["tokenizer"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # no path of a machine
    kept = run.manifest["tokenizer_snapshot"]
    assert "tokenizer.json" in kept and all((RUN / name).is_file() for name in kept)
    assert "Apache License, Version 2.0" in (RUN / "TOKENIZER_LICENSE").read_text()


def test_every_training_rollout_has_reward_and_advantage(rows: list[dict], signals: dict) -> None:
    train = [r for r in rows if not r["validate"]]
    steps = {r["step"] for r in train}
    assert len(steps) >= 4 and len(train) >= 4 * 8 * 4
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in train:
        assert r["reward"] is not None and r["advantage"] is not None  # the listing's columns
        sig = signals[r["id"]]
        assert (sig["reward"], sig["advantage"]) == (r["reward"], r["advantage"])
        assert sig["reward_extra"]["acc"] == sig["reward"]  # verl's GSM8K score
        assert sig["logprob_diff_mean"] is not None and sig["importance_ratio"] is not None
        groups[(r["step"], r["sample_index"])].append(sig)
    assert len(groups) >= 4 * 8 and all(len(g) == 4 for g in groups.values())
    for group in groups.values():
        assert abs(sum(s["advantage"] for s in group)) < 1e-3  # GRPO: centred within the group
        assert len({s["uid"] for s in group}) == 1
    rewards = [s["reward"] for g in groups.values() for s in g]
    assert 0 < sum(rewards) < len(rewards)  # some solved, some not
    assert any(len({s["reward"] for s in g}) > 1 for g in groups.values())  # a group that learns something


def test_validation_rollouts_have_rewards_not_advantages(rows: list[dict], signals: dict) -> None:
    val = [r for r in rows if r["validate"]]
    assert len(val) >= 8
    for r in val:
        assert r["reward"] is not None and r["advantage"] is None
        assert signals[r["id"]]["reward"] == r["reward"]


def test_rollouts_of_a_prompt_differ(run: rlreplay.Run, rows: list[dict]) -> None:
    train = [r for r in rows if not r["validate"]]
    by_group: dict[tuple, list[str]] = defaultdict(list)
    for r in train:
        by_group[(r["step"], r["sample_index"])].append(r["id"])
    differing = 0
    for ids in by_group.values():
        responses = set()
        for traj in run.load(ids):
            (agent,) = traj.by_kind("agent")
            responses.add(tuple(agent.output["response_ids"]))
        differing += len(responses) > 1
    assert differing >= len(by_group) * 3 // 4


def test_show_decodes_with_the_shipped_tokenizer(rows: list[dict], tmp_path: Path) -> None:
    traj_id = next(r["id"] for r in rows if not r["validate"])
    proc = rlreplay_proc(
        "show",
        "-r",
        RUN,
        traj_id,
        cwd=tmp_path,  # nothing but the run folder: the tokenizer ships inside it
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"},
        inherit=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "<tool_call>" in proc.stdout and "####" in proc.stdout
