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


def expected_values(out_a: dict, out_b: dict) -> tuple[str, str | None, str | None]:
    """Where two model outputs first differ (their keys in order, a list's first differing item)
    and the two values there as JSON text (None: that side has none), found by walking them here."""
    for key in out_a:
        va, vb = out_a[key], out_b.get(key)
        if va == vb:
            continue
        if isinstance(va, list) and isinstance(vb, list):
            k = next(i for i in range(max(len(va), len(vb))) if i >= min(len(va), len(vb)) or va[i] != vb[i])
            return f"{key}[{k}]", *(json.dumps(v[k]) if k < len(v) else None for v in (va, vb))
        return key, json.dumps(va), json.dumps(vb)
    raise AssertionError("the outputs are equal")


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
        # how they differ: the path inside the output and both values there
        call = next(i for i, (x, y) in enumerate(zip(result_a[k][1], result_b[k][1])) if x != y)
        path, value_a, value_b = expected_values(result_a[k][1][call], result_b[k][1][call])
        assert (diff["path"], diff["a"], diff["b"]) == (path, value_a, value_b)
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
            diff = r["first_difference"]
            assert diff["name"] == "ToolParser.extract_tool_calls"
            assert diff["field"] == "output"
            # v1 called the tool, v2 returned no call: the call is there in A only
            k = (r["step"], r["sample_index"], r["rollout_n"])
            last = next(o["token_ids"][-1] for o in base[k][1] if o["token_ids"][-1] % 4 != 0)
            call = {"name": "calc", "arguments": {"x": last}}
            assert diff["path"] == "[0]" and diff["b"] is None
            assert json.loads(diff["a"]) == call


def test_a_changed_text_shows_both_values(runs, capsys, tmp_path: Path) -> None:
    """Another tool result: the first difference is the tool's text, shown whole (it is short) on
    both sides, in --json and in the terminal under its pair."""
    run_a = runs[0]
    other = tmp_path / "tool-seed"
    result = record(other, {**BASE, "tool_seed": 1})
    base = runs[2]
    rows = compare_json(capsys, str(run_a), str(other))
    changed = [r for r in rows if not r["same"]]
    assert changed and len(changed) == sum(base[k] != result[k] for k in result)
    for r in changed:
        diff = r["first_difference"]
        k = (r["step"], r["sample_index"], r["rollout_n"])
        x = next(o["token_ids"][-1] for o in base[k][1] if o["token_ids"][-1] % 2 == 0)
        assert (diff["name"], diff["field"], diff["path"]) == ("CalcTool.execute", "output", "text")
        assert (diff["a"], diff["b"]) == (json.dumps(f"result={x * 2}"), json.dumps(f"result={x * 2 + 1}"))
    assert main(["compare", str(run_a), str(other)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for r in changed:
        at = next(i for i, line in enumerate(lines) if line.startswith("changed") and r["a"][:12] in line)
        assert "CalcTool.execute: output at text" in lines[at]
        assert lines[at + 1].split(None, 1) == ["A:", r["first_difference"]["a"]]
        assert lines[at + 2].split(None, 1) == ["B:", r["first_difference"]["b"]]


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
    statuses = [line.split()[0] for line in lines[2:] if not line.startswith(" ")]
    assert statuses == ["changed"] * len(planted) + ["only_a", "only_b"] + ["same"] * (
        len(common) - len(planted)
    )
    changed = [i for i, line in enumerate(lines) if line.startswith("changed")]
    for at in changed:
        assert "span " in lines[at] and "LLMServerClient.generate: output at token_ids[" in lines[at]
        # both values, each on a line of its own under the pair
        assert lines[at + 1].split()[0] == "A:" and lines[at + 2].split()[0] == "B:"
        assert lines[at + 1].split()[1] != lines[at + 2].split()[1]


def test_bad_input_is_one_line_exit_2(runs, capsys, tmp_path: Path) -> None:
    assert main(["compare", str(runs[0]), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlreplay: error:") and len(err.strip().splitlines()) == 1
    assert main(["compare", str(runs[0]), str(runs[1]), "--step", "x..y"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_keys_helper_lists_every_trajectory() -> None:
    assert len(keys(BASE)) == 2 * 3 * 2
