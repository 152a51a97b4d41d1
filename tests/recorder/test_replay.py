"""``rlreplay.replay``: a generic-API agent loop run again with the recorded model calls served.

Expected values come from the source run's files (its spans, read back) and from what the ops
returned when recorded, never from the replay code.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from replay_job import AGENT, GENERATE, run_job

import rlreplay
from rlreplay.cli.main import main
from rlreplay.recorder.replay import ReplayDivergence

BASE = {"steps": 2, "samples": 3, "rollouts": 2, "seed": 0, "parser": "v1"}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("source") / "run"
    rlreplay.init(run_dir, worker="agent_loop_worker_0")
    try:
        result = run_job(BASE)
    finally:
        rlreplay.close()
    return run_dir, result


def replayed(new_run: Path, source_run: Path, config: dict, **kw) -> dict:
    rlreplay.init(new_run, worker="agent_loop_worker_0")
    try:
        with rlreplay.replay(source_run, **kw):
            return run_job(config)
    finally:
        rlreplay.close()


def engine(monkeypatch, tmp_path: Path, down: bool) -> Path:
    log = tmp_path / "engine.log"
    monkeypatch.setenv("REPLAY_JOB_ENGINE_LOG", str(log))
    if down:
        monkeypatch.setenv("REPLAY_JOB_ENGINE_DOWN", "1")
    return log


def engine_calls(log: Path) -> list[tuple[int, ...]]:
    return [tuple(json.loads(line)) for line in log.read_text().splitlines()] if log.exists() else []


def ls_rows(capsys, run_dir: Path) -> dict[tuple, dict]:
    assert main(["ls", str(run_dir), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return {(r["step"], r["sample_index"], r["rollout_n"]): r for r in rows}


def recorded_model_outputs(run_dir: Path) -> dict[tuple, list]:
    """The model calls' outputs as the source run's files hold them, in call order."""
    run = rlreplay.open_run(run_dir)
    out = {}
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        calls = sorted((s for s in traj.spans if s.name == GENERATE), key=lambda s: s.start_ns)
        out[(traj.step, traj.sample_index, traj.rollout_n)] = [s.output for s in calls]
    return out


def bits(value):
    """Floats as their IEEE-754 bits, so that == is bit-exact."""
    if isinstance(value, float):
        return ("f64", struct.pack("<d", value))
    if isinstance(value, dict):
        return {k: bits(v) for k, v in value.items()}
    if isinstance(value, list):
        return [bits(v) for v in value]
    return value


def test_served_model_calls_never_reach_the_engine(source, tmp_path, monkeypatch, capsys) -> None:
    source_run, live = source
    log = engine(monkeypatch, tmp_path, down=True)
    result = replayed(tmp_path / "new", source_run, BASE, serve=("llm",))
    assert engine_calls(log) == []
    files = recorded_model_outputs(source_run)
    assert set(result) == set(live) == set(files)
    for k, value in result.items():
        assert not isinstance(value, Exception), value
        out, outputs = value
        # each served reply is what the op returned when recorded, floats to the bit, types too
        assert bits(outputs) == bits(live[k][1]) == bits(files[k])
        assert [type(o["score"]) for o in outputs] == [float] * len(outputs)
        assert bits(out) == bits(live[k][0])
    source_rows = ls_rows(capsys, source_run)
    rows = ls_rows(capsys, tmp_path / "new")
    for k, row in rows.items():
        assert row["replay"] == "served"
        assert row["replay_of"] == source_rows[k]["id"]
    assert "replay" not in next(iter(source_rows.values()))
    # served spans say so; the parser, tools and agent ran live
    run = rlreplay.open_run(tmp_path / "new")
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        for span in traj.spans:
            if span.kind == "llm":
                assert span.attributes == {"replay": "served"}
            elif span.parent_id is not None:
                assert span.attributes is None


def test_a_divergence_runs_that_call_and_later_ones_live(source, tmp_path, monkeypatch, capsys) -> None:
    source_run, live = source
    log = engine(monkeypatch, tmp_path, down=False)
    # another tool: its reply differs, so a second model call's prompt is not the recorded one
    result = replayed(tmp_path / "new", source_run, {**BASE, "tool_seed": 1}, serve=("llm",))
    with_tool = {k for k, (out, outs) in live.items() if len(outs) >= 2}
    assert with_tool, "the source run has trajectories that called a tool"
    expected_live = sorted((*k, c) for k in with_tool for c in range(1, len(result[k][1])))
    assert sorted(engine_calls(log)) == expected_live
    for k, (_out, outputs) in result.items():
        assert bits(outputs[0]) == bits(live[k][1][0])  # the first call is always served
    rows = ls_rows(capsys, tmp_path / "new")
    assert {k for k, r in rows.items() if r["replay"] == "diverged"} == with_tool
    assert {k for k, r in rows.items() if r["replay"] == "served"} == set(live) - with_tool


def test_on_diverge_fail_raises_in_the_op(source, tmp_path, monkeypatch) -> None:
    source_run, live = source
    log = engine(monkeypatch, tmp_path, down=True)
    result = replayed(
        tmp_path / "new", source_run, {**BASE, "tool_seed": 1}, serve=("llm",), on_diverge="fail"
    )
    with_tool = {k for k, (out, outs) in live.items() if len(outs) >= 2}
    failed = {k for k, v in result.items() if isinstance(v, Exception)}
    assert failed == with_tool
    for k in failed:
        assert isinstance(result[k], ReplayDivergence)
        assert "diverged" in str(result[k]) and GENERATE in str(result[k])
    assert engine_calls(log) == []
    run = rlreplay.open_run(tmp_path / "new")
    errors = {
        (t.step, t.sample_index, t.rollout_n)
        for t in run.load(run.trajectories()["id"].to_pylist())
        if any(s.name == AGENT and s.status == "error" for s in t.spans)
    }
    assert errors == with_tool


def test_trajectories_not_in_the_selection_run_live(source, tmp_path, monkeypatch, capsys) -> None:
    source_run, live = source
    log = engine(monkeypatch, tmp_path, down=False)
    config = {**BASE, "extra": [[5, 0, 0]]}
    result = replayed(tmp_path / "new", source_run, config, serve=("llm",), select={"step": "0"})
    called = {c[:3] for c in engine_calls(log)}
    assert called == {k for k in result if k[0] != 0}
    rows = ls_rows(capsys, tmp_path / "new")
    for k, row in rows.items():
        if k[0] == 0:
            assert row["replay"] == "served"
        else:
            assert (row["replay"], row["replay_of"]) == ("live", None)
    for k in live:  # live calls with the same seed give the recorded replies again
        assert bits(result[k][1]) == bits(live[k][1])


def test_serve_agent_returns_the_recorded_agent_output(source, tmp_path, monkeypatch) -> None:
    source_run, live = source
    log = engine(monkeypatch, tmp_path, down=True)
    result = replayed(tmp_path / "new", source_run, BASE, serve=("agent",))
    assert engine_calls(log) == []
    for k, (out, outputs) in result.items():
        assert bits(out) == bits(live[k][0])
        assert outputs == []  # the agent loop's body never ran


def test_replay_needs_recording_and_a_source(source, tmp_path) -> None:
    with (
        pytest.raises(rlreplay.playback.ReplayError, match="records the new run"),
        rlreplay.replay(source[0]),
    ):
        pass
    rlreplay.init(tmp_path / "new")
    try:
        with (
            pytest.raises(rlreplay.playback.ReplayError, match="source run"),
            rlreplay.replay(tmp_path / "missing"),
        ):
            pass
        with (
            pytest.raises(rlreplay.playback.ReplayError, match="unknown kind"),
            rlreplay.replay(source[0], serve=("gpu",)),
        ):
            pass
        with (
            pytest.raises(rlreplay.playback.ReplayError, match="matches no trajectory"),
            rlreplay.replay(source[0], select={"step": "99"}),
        ):
            pass
    finally:
        rlreplay.close()


def test_serve_llm_and_tool_keeps_a_changed_tool_from_diverging(
    source, tmp_path, monkeypatch, capsys
) -> None:
    source_run, live = source
    log = engine(monkeypatch, tmp_path, down=True)
    # the tool now answers otherwise, but its recorded replies are served: nothing diverges
    result = replayed(tmp_path / "new", source_run, {**BASE, "tool_seed": 1}, serve=("llm", "tool"))
    assert engine_calls(log) == []
    for k, (out, outputs) in result.items():
        assert bits(outputs) == bits(live[k][1])
        assert bits(out) == bits(live[k][0])
    assert {r["replay"] for r in ls_rows(capsys, tmp_path / "new").values()} == {"served"}
