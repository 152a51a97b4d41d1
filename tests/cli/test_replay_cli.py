"""``rlreplay replay SOURCE -- CMD`` on a generic-API job whose steps run in spawned processes.

Expected values (ops served, diverged and never-asked trajectories) are counted here from the
source run's files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import rlreplay_proc

import rlreplay

JOB = Path(__file__).resolve().parents[1] / "replay_job.py"
BASE = {"steps": 2, "samples": 3, "rollouts": 2, "seed": 0, "parser": "v1", "spawn": True}


def cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return rlreplay_proc(*args, cwd=cwd, env=env)


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
    assert f"1 source trajectory never asked for ({facts[(1, 2, 1)]['id']})" in line
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
        "other adapter": [str(source), "--framework", "verl"],  # named, and not the source's
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


PLAIN = {"steps": 2, "samples": 3, "rollouts": 1, "seed": 0}  # one process: quicker


def recorded(base: Path, config: dict, *options: str) -> Path:
    proc = cli(base, "record", *options, "--out", str(base / "src"), "--", *job(config))
    assert proc.returncode == 0, proc.stderr
    return base / "src"


def summary_lines(stderr: str) -> list[str]:
    """The end-of-run summary of ``rlreplay replay``: its line, then the lines it adds."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rlreplay: replay of "))
    return [line for line in lines[start:] if line.startswith("rlreplay: replay")]


def test_a_generic_job_is_recorded_and_replayed_with_the_defaults(tmp_path: Path) -> None:
    """No --framework anywhere: the run names the framework its job traced through (generic here),
    and its model calls are served as the dicts they returned (not rebuilt into verl's types)."""
    source = recorded(tmp_path, PLAIN)
    assert rlreplay.open_run(source).manifest["framework"] == "generic"
    env = {"REPLAY_JOB_ENGINE_DOWN": "1"}
    proc = cli(tmp_path, "replay", str(source), "--out", str(tmp_path / "new"), "--", *job(PLAIN), env=env)
    assert proc.returncode == 0, proc.stderr
    served = sum(f["calls"] for f in source_facts(source).values())
    assert f"{served} ops served; 0 trajectories diverged" in proc.stderr
    assert {r["replay"] for r in ls_rows(tmp_path / "new").values()} == {"served"}


@pytest.mark.parametrize("on_diverge", ["live", "fail"])
def test_a_source_that_goes_away_during_the_replay_is_not_silent(tmp_path: Path, on_diverge: str) -> None:
    """The job's processes read the source when their first trajectory opens; it is gone by then."""
    source = recorded(tmp_path, PLAIN)
    kept = tmp_path / "kept"
    shutil.copytree(source, kept)  # what the source held, to count from
    args = ("replay", str(source), "--on-diverge", on_diverge, "--out", str(tmp_path / "new"))
    proc = cli(tmp_path, *args, "--", *job({**PLAIN, "remove": str(source)}))
    assert not source.exists()
    rows = ls_rows(tmp_path / "new")
    assert set(rows) == set(source_facts(kept))
    for row in rows.values():
        assert row["replay"] == "diverged" and row["replay_of"] is None
        assert row["replay_reason"].startswith(f"the source run could not be read (source run {source}")
    lines = summary_lines(proc.stderr)
    assert lines[0].startswith(f"rlreplay: replay of {source}: 0 ops served")
    assert (
        f"rlreplay: replay: {len(rows)} trajectories were not served: the source run could not be read"
        in ("\n".join(lines))
    )
    if on_diverge == "fail":
        assert proc.returncode != 0  # every trajectory's first model call raised ReplayDivergence
    else:
        assert proc.returncode == 0, proc.stderr  # they ran live, and the summary says why


def truncate_step(run: Path, step: int) -> str:
    [shard] = (run / "spans" / f"step={step}").glob("*/*.parquet")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return str(shard.relative_to(run))


def test_a_truncated_source_shard_is_named_and_never_read_as_an_empty_selection(tmp_path: Path) -> None:
    source = recorded(tmp_path, PLAIN)
    facts = source_facts(source)
    damaged = truncate_step(source, 1)
    command = ("--", *job(PLAIN))
    only = cli(tmp_path, "replay", str(source), "--step", "1", "--out", str(tmp_path / "a"), *command)
    assert only.returncode == 2 and len(only.stderr.strip().splitlines()) == 1
    assert damaged in only.stderr and "matches no trajectory" not in only.stderr
    failing = cli(
        tmp_path, "replay", str(source), "--on-diverge", "fail", "--out", str(tmp_path / "b"), *command
    )
    assert failing.returncode == 2 and len(failing.stderr.strip().splitlines()) == 1
    assert failing.stderr.startswith("rlreplay: error:") and damaged in failing.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # with --on-diverge live: what can be read is served, the rest runs live and says why
    live = cli(tmp_path, "replay", str(source), "--out", str(tmp_path / "c"), *command)
    assert live.returncode == 0, live.stderr
    assert damaged in live.stderr.splitlines()[0] and "warning" in live.stderr.splitlines()[0]
    rows = ls_rows(tmp_path / "c")
    for k, row in rows.items():
        if k[0] == 0:
            assert (row["replay"], row["replay_of"]) == ("served", facts[k]["id"])
        else:
            assert row["replay"] == "diverged" and damaged in row["replay_reason"]
    served = sum(f["calls"] for k, f in facts.items() if k[0] == 0)
    assert f"{served} ops served" in summary_lines(live.stderr)[0]


def test_the_summary_names_the_source_as_given_and_a_few_ids(tmp_path: Path) -> None:
    """Never-asked and diverged trajectories: at most five ids each, then how many more."""
    config = {"steps": 1, "samples": 9, "rollouts": 1, "seed": 0}
    source = recorded(tmp_path, config, "--framework", "generic")
    facts = source_facts(source)
    given = "./src/"  # relative, as typed
    args = ("replay", given, "--framework", "generic", "--out", str(tmp_path / "new"))
    proc = cli(tmp_path, *args, "--", *job({**config, "samples": 1}))
    assert proc.returncode == 0, proc.stderr
    [line] = summary_lines(proc.stderr)
    never = sorted(f["id"] for k, f in facts.items() if k[1] != 0)
    assert line.startswith(f"rlreplay: replay of {given}: ")
    assert len(never) == 8
    shown = line.split("8 source trajectories never asked for (", 1)[1].rstrip(")")
    ids = shown.split(", ... ")[0].split(", ")
    assert len(ids) == 5 and set(ids) <= set(never) and shown.endswith(", ... 3 more")


@pytest.mark.parametrize(("on_diverge", "code"), [("live", 0), ("fail", 1)])
def test_under_fail_a_divergence_is_the_exit_code_even_when_the_job_swallows_it(
    tmp_path: Path, on_diverge: str, code: int
) -> None:
    source = recorded(tmp_path, PLAIN)
    config = {**PLAIN, "tool_seed": 1, "exit_zero": True}  # another tool reply: 2nd model calls differ
    args = ("replay", str(source), "--on-diverge", on_diverge, "--out", str(tmp_path / "new"))
    proc = cli(tmp_path, *args, "--", *job(config))
    assert proc.returncode == code, proc.stderr
    diverged = [r for r in ls_rows(tmp_path / "new").values() if r["replay"] == "diverged"]
    assert diverged and f"{len(diverged)} trajectories diverged" in summary_lines(proc.stderr)[0]


def test_the_summary_says_why_each_diverged_for_at_most_five_and_points_at_the_rest(tmp_path: Path) -> None:
    config = {"steps": 1, "samples": 24, "rollouts": 1, "seed": 0}
    source = recorded(tmp_path, config)
    facts = source_facts(source)
    diverged = sorted(
        f["id"] for f in facts.values() if f["calls"] >= 2
    )  # another tool reply: call 2 differs
    assert len(diverged) > 5
    new = tmp_path / "new"
    proc = cli(tmp_path, "replay", str(source), "--out", str(new), "--", *job({**config, "tool_seed": 1}))
    assert proc.returncode == 0, proc.stderr
    lines = summary_lines(proc.stderr)
    shown = lines[0].split(f"{len(diverged)} trajectories diverged (", 1)[1].split(")", 1)[0]
    ids = shown.split(", ... ")[0].split(", ")
    assert len(ids) == 5 and set(ids) <= set(diverged)
    assert shown.endswith(f", ... {len(diverged) - 5} more")
    why = {r["replay_of"]: r["replay_reason"] for r in ls_rows(new).values() if r["replay"] == "diverged"}
    assert sorted(why) == diverged
    said = [line for line in lines[1:-1] if " diverged: " in line]
    assert said == [f"rlreplay: replay: {i} diverged: {why[i]}" for i in ids]
    assert lines[-1] == (
        f"rlreplay: replay: why the other {len(diverged) - 5} diverged: "
        f"replay_reason in `rlreplay ls {new} --json`"
    )


@pytest.mark.parametrize("on_diverge", ["live", "fail"])
def test_a_source_removed_after_some_trajectories_were_served_serves_what_it_read_or_says_why(
    tmp_path: Path, on_diverge: str
) -> None:
    """The source goes away after the job's third trajectory: each later one is served as recorded
    (read before it went: ``compare`` finds it the same) or diverges naming the source; under
    ``fail`` that is a non-zero exit."""
    source = recorded(tmp_path, PLAIN)
    kept = tmp_path / "kept"
    shutil.copytree(source, kept)
    facts = source_facts(kept)
    new = tmp_path / "new"
    args = ("replay", str(source), "--on-diverge", on_diverge, "--out", str(new))
    proc = cli(tmp_path, *args, "--", *job({**PLAIN, "remove_after": [3, str(source)]}))
    assert not source.exists()
    rows = ls_rows(new)
    assert set(rows) == set(facts)
    order = sorted(rows)  # the job's order: step, sample_index, rollout_n
    for k in order[:3]:
        assert (rows[k]["replay"], rows[k]["replay_of"]) == ("served", facts[k]["id"])
    unserved = [k for k in order[3:] if rows[k]["replay"] != "served"]
    for k in unserved:
        assert rows[k]["replay"] == "diverged"
        assert rows[k]["replay_reason"].startswith(f"the source run could not be read (source run {source}")
    for k in order[3:]:
        if k not in unserved:
            assert rows[k]["replay_of"] == facts[k]["id"]
    lines = summary_lines(proc.stderr)
    served = sum(facts[k]["calls"] for k in order if k not in unserved)
    assert lines[0].startswith(f"rlreplay: replay of {source}: {served} ops served")
    if unserved:
        assert f"rlreplay: replay: {len(unserved)} trajectories were not served: the source run" in lines
    # what was served is what the source held, bit for bit
    pairs = cli(tmp_path, "compare", str(kept), str(new), "--json").stdout.splitlines()
    assert len(pairs) == len(facts)
    for pair in map(json.loads, pairs):
        keys = (pair["step"], pair["sample_index"], pair["rollout_n"])
        assert pair["same"] == (keys not in unserved), pair
    if on_diverge == "fail":
        assert (proc.returncode != 0) == bool(unserved), proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("on_diverge", ["live", "fail"])
def test_the_jobs_own_non_zero_exit_code_comes_first(tmp_path: Path, on_diverge: str) -> None:
    """The job fails (its diverged calls raise: the engine is down, or ``ReplayDivergence``) and exits 3:
    the command exits 3, not 1."""
    source = recorded(tmp_path, PLAIN)
    config = {**PLAIN, "tool_seed": 1, "exit_code": 3}
    args = ("replay", str(source), "--on-diverge", on_diverge, "--out", str(tmp_path / "new"))
    proc = cli(tmp_path, *args, "--", *job(config), env={"REPLAY_JOB_ENGINE_DOWN": "1"})
    diverged = [r for r in ls_rows(tmp_path / "new").values() if r["replay"] == "diverged"]
    assert diverged and f"{len(diverged)} trajectories diverged" in summary_lines(proc.stderr)[0]
    assert proc.returncode == 3, proc.stderr
