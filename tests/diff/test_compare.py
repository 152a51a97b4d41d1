"""``rlreplay compare`` on two runs recorded by the real recorder with known, planted differences.

Expected pairs, turns and reward deltas are computed here from what the agent loops returned
(their response ids and masks), never through ``rlreplay.compare``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from replay_job import keys, run_job

import rlreplay
from rlreplay.cli.main import main

BASE = {"steps": 2, "samples": 3, "rollouts": 2, "seed": 0, "parser": "v1"}


def record(run_dir: Path, config: dict) -> dict:
    rlreplay.init(run_dir, worker="agent_loop_worker_0")
    try:
        return run_job(config)
    finally:
        rlreplay.close()


def expected_turn(a: dict, b: dict) -> int:
    """The turn holding the first differing response id: mask runs after the prompt (turn 0)."""
    ra, rb = a["response_ids"], b["response_ids"]
    k = next(i for i in range(min(len(ra), len(rb)) + 1) if i == min(len(ra), len(rb)) or ra[i] != rb[i])
    mask = a["response_mask"] if k < len(ra) else b["response_mask"]
    turn = 1
    for i in range(1, k + 1):
        if mask[i] != mask[i - 1]:
            turn += 1
    return turn


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("compare")
    result_a = record(base / "a", BASE)
    # plant: the first model call of one trajectory, the second of another that called a tool
    first = (1, 2, 0)
    second = next(k for k, (out, outs) in sorted(result_a.items()) if len(outs) >= 2 and k != first)
    config_b = {
        **BASE,
        "changes": {"1:2:0:0": 7, ":".join(map(str, (*second, 1))): 7},
        "skip": [[0, 0, 1]],
        "extra": [[2, 0, 0]],
    }
    result_b = record(base / "b", config_b)
    return base / "a", base / "b", result_a, result_b, {first: 2, second: 5}


def compare_json(capsys, *args: str) -> list[dict]:
    assert main(["compare", *args, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_pairs_same_changed_and_in_one_run_only(runs, capsys) -> None:
    run_a, run_b, result_a, result_b, planted = runs
    rows = compare_json(capsys, str(run_a), str(run_b))
    assert all(
        set(r) >= {"step", "sample_index", "rollout_n", "validate", "a", "b", "same", "first_difference"}
        for r in rows
    )
    by_keys = {(r["step"], r["sample_index"], r["rollout_n"]): r for r in rows}
    assert set(by_keys) == set(result_a) | set(result_b)
    assert len(rows) == len(by_keys)
    only_a = {k for k, r in by_keys.items() if r["b"] is None}
    only_b = {k for k, r in by_keys.items() if r["a"] is None}
    assert only_a == set(result_a) - set(result_b) == {(0, 0, 1)}
    assert only_b == set(result_b) - set(result_a) == {(2, 0, 0)}
    changed = {k for k, r in by_keys.items() if r["a"] and r["b"] and not r["same"]}
    # the planted keys, and no other: everything else agrees to the bit (ids and uuids aside)
    expected_changed = {k for k in set(result_a) & set(result_b) if result_a[k][1] != result_b[k][1]}
    assert changed == expected_changed == set(planted)
    for k, span in planted.items():
        diff = by_keys[k]["first_difference"]
        out_a, out_b = result_a[k][0], result_b[k][0]
        assert diff["span"] == span
        assert diff["name"] == "LLMServerClient.generate"
        assert diff["field"] == "output"
        assert diff["turn"] == expected_turn(out_a, out_b)
    for k, r in by_keys.items():
        if r["same"]:
            assert r["first_difference"] is None
            assert r["reward_a"] == r["reward_b"] == result_a[k][0]["reward_score"]


def test_a_changed_input_is_named_with_its_path(runs, capsys, tmp_path: Path) -> None:
    run_a = runs[0]
    other = tmp_path / "parser-v2"
    result = record(other, {**BASE, "parser": "v2"})
    rows = compare_json(capsys, str(run_a), str(other), "--step", "0")
    base = runs[2]
    # a trajectory changes exactly where a model reply ends in an id even but not a multiple of 4
    parse_changed = {
        k
        for k, (out, outs) in base.items()
        if k[0] == 0 and any(o["token_ids"][-1] % 2 == 0 and o["token_ids"][-1] % 4 != 0 for o in outs)
    }
    assert parse_changed == {k for k in result if k[0] == 0 and result[k] != base[k]}
    changed = {(r["step"], r["sample_index"], r["rollout_n"]) for r in rows if not r["same"]}
    assert {r["step"] for r in rows} == {0}
    assert changed == parse_changed
    # the parser's output is where they first part: v1 calls the tool on even ids, v2 on multiples of 4
    for r in rows:
        if not r["same"]:
            assert r["first_difference"]["name"] == "ToolParser.extract_tool_calls"
            assert r["first_difference"]["field"] == "output"


def test_terminal_summary_lists_changed_first(runs, capsys) -> None:
    run_a, run_b, result_a, result_b, planted = runs
    assert main(["compare", str(run_a), str(run_b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    common = set(result_a) & set(result_b)
    assert lines[0] == (
        f"{len(common) + 2} pairs: {len(common) - len(planted)} same, {len(planted)} changed, "
        "1 only in A, 1 only in B"
    )
    deltas = [result_b[k][0]["reward_score"] - result_a[k][0]["reward_score"] for k in common]
    assert lines[1].startswith(f"reward: {sum(d != 0 for d in deltas)} changed, delta sum {sum(deltas):+g}")
    statuses = [line.split()[0] for line in lines[2:]]
    assert statuses == ["changed"] * len(planted) + ["only_a", "only_b"] + ["same"] * (
        len(common) - len(planted)
    )
    for line in lines[2 : 2 + len(planted)]:
        assert "span " in line and "LLMServerClient.generate: output" in line


def test_bad_input_is_one_line_exit_2(runs, capsys, tmp_path: Path) -> None:
    assert main(["compare", str(runs[0]), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlreplay: error:") and len(err.strip().splitlines()) == 1
    assert main(["compare", str(runs[0]), str(runs[1]), "--step", "x..y"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_keys_helper_lists_every_trajectory() -> None:
    assert len(keys(BASE)) == 2 * 3 * 2
