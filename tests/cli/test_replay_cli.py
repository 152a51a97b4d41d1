"""``rlreplay replay SOURCE -- CMD`` on a generic-API job whose steps run in spawned processes.

Expected values (ops served, diverged and never-asked trajectories) are counted here from the
source run's files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import rlreplay_cli

import rlreplay

JOB = Path(__file__).resolve().parents[1] / "replay_job.py"
BASE = {"steps": 2, "samples": 3, "rollouts": 2, "seed": 0, "parser": "v1", "spawn": True}


def cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return rlreplay_cli(*args, cwd=cwd, env=env)


def job(config: dict) -> list[str]:
    return [sys.executable, str(JOB), json.dumps(config)]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("replay-cli")
    proc = cli(base, "record", "--framework", "generic", "--out", str(base / "src"), "--", *job(BASE))
    assert proc.returncode == 0, proc.stderr
    return base / "src"


def source_facts(run_dir: Path) -> dict[tuple, dict]:
    """Per keys: the trajectory id and how many model calls it recorded."""
    run = rlreplay.open_run(run_dir)
    out = {}
    for traj in run.load(run.trajectories()["id"].to_pylist()):
        calls = sum(1 for s in traj.spans if s.kind == "llm")
        out[(traj.step, traj.sample_index, traj.rollout_n)] = {"id": traj.id, "calls": calls}
    return out


def ls_rows(run_dir: Path) -> dict[tuple, dict]:
    proc = cli(run_dir.parent, "ls", str(run_dir), "--json")
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    return {(r["step"], r["sample_index"], r["rollout_n"]): r for r in rows}


def test_replay_serves_model_calls_in_every_process(source: Path, tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    env = {"REPLAY_JOB_ENGINE_LOG": str(log), "REPLAY_JOB_ENGINE_DOWN": "1"}
    new = tmp_path / "new"
    args = ("replay", str(source), "--framework", "generic", "--out", str(new), "--", *job(BASE))
    proc = cli(tmp_path, *args, env=env)
    assert proc.returncode == 0, proc.stderr
    assert not log.exists()  # no model call reached the engine, in any process
    facts = source_facts(source)
    rows = ls_rows(new)
    assert set(rows) == set(facts)
    for k, row in rows.items():
        assert (row["replay"], row["replay_of"]) == ("served", facts[k]["id"])
    served = sum(f["calls"] for f in facts.values())
    assert (
        f"{served} ops served; 0 trajectories diverged; 0 source trajectories never asked for" in proc.stderr
    )
    assert rlreplay.open_run(new).manifest["replay"]["source"] == str(source.resolve())


def test_summary_names_diverged_and_never_asked(source: Path, tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    config = {**BASE, "tool_seed": 1, "skip": [[1, 2, 1]]}
    new = tmp_path / "new"
    args = ("replay", str(source), "--framework", "generic", "--step", "0..1", "--out", str(new))
    proc = cli(tmp_path, *args, "--", *job(config), env={"REPLAY_JOB_ENGINE_LOG": str(log)})
    assert proc.returncode == 0, proc.stderr
    facts = source_facts(source)
    diverged = sorted(f["id"] for k, f in facts.items() if f["calls"] >= 2 and k != (1, 2, 1))
    assert diverged
    line = next(line for line in proc.stderr.splitlines() if "ops served" in line)
    assert f"{len(diverged)} trajectories diverged ({', '.join(diverged)})" in line
    assert f"1 source trajectories never asked for ({facts[(1, 2, 1)]['id']})" in line
    served = sum(1 if f["calls"] >= 2 else f["calls"] for k, f in facts.items() if k != (1, 2, 1))
    assert f"{served} ops served" in line
    rows = ls_rows(new)
    by_source = {r["replay_of"]: r for r in rows.values()}
    for source_id in diverged:  # why each diverged: in its listing row and in show's header
        row = by_source[source_id]
        assert row["replay"] == "diverged"
        assert row["replay_reason"].startswith("LLMServerClient.generate call 2 has other inputs")
        show = cli(tmp_path, "show", str(new), row["id"], "--no-text")
        assert show.returncode == 0, show.stderr
        assert f"replay=diverged of {source_id}: {row['replay_reason']}" in show.stdout
    assert {r["replay_reason"] for r in rows.values() if r["replay"] != "diverged"} == {None}


def test_match_on_reaches_every_process(source: Path, tmp_path: Path) -> None:
    """``--match-on position,name``: model calls whose prompts changed (another tool reply) are
    served all the same, in each spawned process; the manifest records the whole replay."""
    log = tmp_path / "engine.log"
    env = {"REPLAY_JOB_ENGINE_LOG": str(log), "REPLAY_JOB_ENGINE_DOWN": "1"}
    new = tmp_path / "new"
    args = ("replay", str(source), "--framework", "generic", "--match-on", "position,name", "--step", "0..1")
    proc = cli(tmp_path, *args, "--out", str(new), "--", *job({**BASE, "tool_seed": 1}), env=env)
    assert proc.returncode == 0, proc.stderr
    assert not log.exists()
    served = sum(f["calls"] for f in source_facts(source).values())
    assert f"{served} ops served; 0 trajectories diverged" in proc.stderr
    assert rlreplay.open_run(new).manifest["replay"] == {
        "source": str(source.resolve()),
        "serve": ["llm"],
        "on_diverge": "live",
        "match_on": ["position", "name"],
        "select": {"step": "0..1"},
    }


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "source run"),
        ("not a run", "source run"),
        ("other adapter", "recorded with the generic adapter"),
        ("selects nothing", "matches no trajectory"),
        ("unknown kind", "unknown kind"),
        ("unknown matcher", "unknown matcher 'prompt'"),
    ],
)
def test_bad_input_never_starts_the_command(source: Path, tmp_path: Path, case: str, message: str) -> None:
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    (tmp_path / "file").write_text("not a run")
    opts = {
        "missing": [str(tmp_path / "nowhere"), "--framework", "generic"],
        "not a run": [str(tmp_path / "file"), "--framework", "generic"],
        "other adapter": [str(source)],  # the default adapter is verl
        "selects nothing": [str(source), "--framework", "generic", "--step", "99"],
        "unknown kind": [str(source), "--framework", "generic", "--serve", "llm,gpu"],
        "unknown matcher": [str(source), "--framework", "generic", "--match-on", "position,prompt"],
    }[case]
    proc = cli(tmp_path, "replay", *opts, "--out", str(tmp_path / "new"), "--", *command)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert proc.stderr.startswith("rlreplay: error:")
    assert not marker.exists()
    assert not (tmp_path / "new").exists()


def test_every_process_is_told_the_source_as_given(tmp_path: Path, monkeypatch, capsys) -> None:
    """A source on an object store reaches the job's processes as its URI, not as the local cache
    ``rlreplay replay`` read it through (``tests/remote``: the same on a real S3 server)."""
    from rlreplay.cli.main import main
    from rlreplay.playback import ReplayConfig

    monkeypatch.setenv("RLREPLAY_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("RLREPLAY_CACHE", str(tmp_path / "cache"))
    uri = f"memory://runs/{tmp_path.name}/src"
    rlreplay.init(uri)
    try:
        with rlreplay.trajectory(step=0, sample_index=0, rollout_n=0):
            pass
    finally:
        rlreplay.close()
    seen = tmp_path / "seen.json"
    told = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"
    args = ["replay", uri, "--framework", "generic", "--out", str(tmp_path / "new")]
    assert main([*args, "--", sys.executable, "-c", told, str(seen)]) == 0
    assert ReplayConfig.from_env(json.loads(seen.read_text())) == ReplayConfig.of(uri, "llm")
    assert rlreplay.open_run(tmp_path / "new").manifest["replay"]["source"] == uri
