"""``rlreplay.replay``: a generic-API agent loop run again with the recorded model calls served.

Expected values come from the source run's files (its spans, read back) and from what the ops
returned when recorded, never from the replay code.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from replay_job import AGENT, GENERATE, run_job

import rlreplay
from rlreplay.cli.main import main
from rlreplay.format.keys import TrajectoryKey
from rlreplay.playback import ReplayConfig, ReplayError
from rlreplay.read.selection import Selection
from rlreplay.recorder.replay import Cassette, ReplayDivergence

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


def replayed(new_run: Path, source_run: Path | str, config: dict, **kw) -> dict:
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


def source_calls(run_dir: Path) -> dict[tuple, list]:
    """Each trajectory's model-call spans (the source run's files), in call order."""
    run = rlreplay.open_run(run_dir)
    out = {}
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        calls = sorted((s for s in traj.spans if s.name == GENERATE), key=lambda s: s.start_ns)
        out[(traj.step, traj.sample_index, traj.rollout_n)] = (traj.id, calls)
    return out


def first_index(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_a_divergence_keeps_its_reason_on_the_span_the_root_and_the_listing(
    source, tmp_path, monkeypatch, capsys
) -> None:
    """With --on-diverge live the call that diverged runs live, and why it diverged stays: on that
    span, on the trajectory's root, in ``ls --json`` (``replay_reason``) and in ``show``."""
    source_run, _ = source
    engine(monkeypatch, tmp_path, down=False)
    rlreplay.init(tmp_path / "new", worker="agent_loop_worker_0")
    try:
        with rlreplay.replay(source_run, serve=("llm",)) as cassette:
            run_job({**BASE, "tool_seed": 1})  # another tool reply: the 2nd model call's prompt differs
    finally:
        rlreplay.close()
    recorded, replayed = source_calls(source_run), source_calls(tmp_path / "new")
    expected = {}
    for k, (source_id, calls) in recorded.items():
        if len(calls) < 2:
            continue
        new_calls = replayed[k][1]
        at = first_index(calls[1].inputs["prompt_ids"], new_calls[1].inputs["prompt_ids"])
        expected[k] = (source_id, calls[1].span_id, at)
    assert expected, "the source run has trajectories with a second model call"
    rows = ls_rows(capsys, tmp_path / "new")
    assert {k for k, r in rows.items() if r["replay"] == "diverged"} == set(expected)
    run = rlreplay.open_run(tmp_path / "new")
    for k, row in rows.items():
        if k not in expected:
            assert (row["replay"], row["replay_reason"]) == ("served", None)
            continue
        source_id, span_id, at = expected[k]
        reason = row["replay_reason"]
        assert f"{GENERATE} call 2 " in reason and span_id in reason and f"prompt_ids[{at}]" in reason
        assert cassette.divergences[source_id] == reason
        traj = run.trajectory(row["id"])
        assert (traj.attributes["replay"], traj.attributes["replay_reason"]) == ("diverged", reason)
        marks = [s.attributes for s in replayed[k][1]]
        assert marks[:2] == [{"replay": "served"}, {"replay": "diverged", "replay_reason": reason}]
        assert all(m is None for m in marks[2:])  # later calls ran live, unmarked
        assert main(["show", str(tmp_path / "new"), row["id"], "--no-text"]) == 0
        assert f"replay=diverged of {source_id}: {reason}" in capsys.readouterr().out
        assert main(["show", str(tmp_path / "new"), row["id"], "--json", "--no-text"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["replay"], shown["replay_of"], shown["replay_reason"]) == (
            "diverged",
            source_id,
            reason,
        )
    assert sorted(cassette.diverged) == sorted(v[0] for v in expected.values())


def test_match_on_names_what_a_call_must_share_with_its_recording(
    source, tmp_path, monkeypatch, capsys
) -> None:
    """Without ``inputs`` among the matchers, a model call whose prompt changed is still served."""
    source_run, live = source
    log = engine(monkeypatch, tmp_path, down=True)
    result = replayed(
        tmp_path / "new", source_run, {**BASE, "tool_seed": 1}, serve=("llm",), match_on=("position", "name")
    )
    assert engine_calls(log) == []
    for k, (_out, outputs) in result.items():
        assert bits(outputs) == bits(live[k][1])
    assert {r["replay"] for r in ls_rows(capsys, tmp_path / "new").values()} == {"served"}
    record = rlreplay.open_run(tmp_path / "new").manifest["replay"]
    assert record["match_on"] == ["position", "name"]
    with pytest.raises(ReplayError, match="unknown matcher 'prompt'"):
        ReplayConfig.of(source_run, match_on="position,prompt")


def test_a_cassette_serves_plain_calls_outside_the_recorder(source) -> None:
    """What a proxy in front of a model server needs: (kind, name, inputs) in, the recorded output
    out, bit for bit, or not served and why; per-call ids are not compared."""
    source_run, _ = source
    calls = source_calls(source_run)
    k, (source_id, spans) = next((k, v) for k, v in calls.items() if len(v[1]) >= 2)
    key = TrajectoryKey.of(*k, validate=False)
    config = ReplayConfig.of(source_run, "llm")

    cassette = config.cassette()
    state = cassette.open(key)
    first = {**spans[0].inputs, "request_id": "another-id"}
    played = cassette.play(state, "llm", GENERATE, first)
    assert played.served and bits(played.output) == bits(spans[0].output) and played.reason is None
    changed = {**spans[1].inputs, "prompt_ids": [*spans[1].inputs["prompt_ids"], 7]}
    played = cassette.play(state, "llm", GENERATE, changed)
    at = len(spans[1].inputs["prompt_ids"])
    assert not played.served and f"prompt_ids[{at}]" in played.reason and spans[1].span_id in played.reason
    assert (state.status, cassette.divergences) == ("diverged", {source_id: played.reason})
    assert cassette.play(state, "llm", GENERATE, spans[1].inputs) == cassette.play(state, "llm", "x", {})
    assert not cassette.play(state, "llm", GENERATE, spans[1].inputs).served  # diverged: all live now
    assert cassette.open(TrajectoryKey.of(99, 0, 0)).status == "live"

    # without the position matcher, calls are served from the recorded op whose inputs they have
    unordered = ReplayConfig.of(source_run, "llm", match_on=("name", "inputs")).cassette()
    state = unordered.open(key)
    for span in reversed(spans):
        played = unordered.play(state, "llm", span.name, span.inputs)
        assert played.served and bits(played.output) == bits(span.output)
    assert not unordered.play(state, "llm", GENERATE, spans[0].inputs).served  # each op once

    def broken(op, call):
        raise KeyError("no such field")

    strict = Cassette(("llm",), cassette.recording, match_on=(broken,))
    played = strict.play(strict.open(key), "llm", GENERATE, spans[0].inputs)
    assert not played.served and played.reason == "matcher 'broken' failed: KeyError: 'no such field'"

    def unbuildable(name, kind, output, output_type):
        raise ValueError("Image must be a list")

    recording = replace(cassette.recording, rebuild=unbuildable)
    bad = Cassette(("llm",), recording)
    state = bad.open(key)
    played = bad.play(state, "llm", GENERATE, spans[0].inputs)  # not raised into the caller
    assert not played.served and bad.served == 0 and state.status == "diverged"
    assert played.reason == (
        f"{GENERATE} call 1: the recorded output of span {spans[0].span_id} cannot be rebuilt "
        "(ValueError: Image must be a list)"
    )

    failing = Cassette(("llm",), cassette.recording, on_diverge="fail")
    played = failing.play(failing.open(key), "llm", "Other.generate", spans[0].inputs)
    assert isinstance(played.error, ReplayDivergence) and played.reason in str(played.error)
    assert played.reason == f"llm call 1 is Other.generate, recorded {GENERATE}"


def test_a_source_on_an_object_store_is_named_as_given(tmp_path, monkeypatch, capsys) -> None:
    """A source given as a URI is read from the store, and the new run's manifest names the URI
    (not the local cache it was read through)."""
    monkeypatch.setenv("RLREPLAY_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("RLREPLAY_CACHE", str(tmp_path / "cache"))
    uri = f"memory://runs/{tmp_path.name}/src"
    config = {**BASE, "steps": 1}
    rlreplay.init(uri, worker="agent_loop_worker_0")
    try:
        live = run_job(config)
    finally:
        rlreplay.close()
    log = engine(monkeypatch, tmp_path, down=True)
    result = replayed(tmp_path / "new", uri, config, serve=("llm",))
    assert engine_calls(log) == []
    assert {k: bits(v[1]) for k, v in result.items()} == {k: bits(v[1]) for k, v in live.items()}
    record = rlreplay.open_run(tmp_path / "new").manifest["replay"]
    assert record["source"] == uri
    assert ReplayConfig.from_manifest({"replay": record}) == ReplayConfig.of(uri, "llm")


@pytest.mark.parametrize(
    "config",
    [
        ReplayConfig("/runs/a b/ü-run"),
        ReplayConfig("s3://bucket/p/run?region=eu-west-1", ("llm", "tool"), on_diverge="fail"),
        ReplayConfig(
            "/r",
            ("agent",),
            Selection(step="0..3", sample_index="a,12", rollout_n="1", validate=True, where="reward > 0.5"),
            "live",
            ("name", "inputs"),
        ),
        ReplayConfig("/r", selection=Selection(experiment='e"x', status="ok", sort="-reward", limit=3)),
    ],
)
def test_a_replay_config_travels_through_the_environment_and_the_manifest(config: ReplayConfig) -> None:
    assert ReplayConfig.from_env(config.env()) == config
    assert ReplayConfig.from_manifest(json.loads(json.dumps({"replay": config.record()}))) == config
    assert ReplayConfig.from_env({}) is None and ReplayConfig.from_manifest({}) is None


def test_a_replay_config_reads_an_older_manifest_record() -> None:
    """Runs replayed before the record named its selection and matchers."""
    old = {"replay": {"source": "/runs/src", "serve": ["llm", "tool"], "on_diverge": "fail"}}
    assert ReplayConfig.from_manifest(old) == ReplayConfig("/runs/src", ("llm", "tool"), on_diverge="fail")
    assert ReplayConfig.from_manifest({"replay": {"serve": ["llm"]}}) is None
    assert ReplayConfig.from_manifest({"replay": {"source": "/r", "select": {"stepp": "1"}}}) is None
