# ruff: noqa: F811  (the store fixture, imported from test_object_store, is the tests' argument)
"""Whole-run questions on a run on an object store: the run's kept tokenizer comes with it, and
``--engine ray`` on a real 3-node Ray cluster answers as ``--engine local`` does on a local copy.

The shipped showcase run is uploaded to a real S3 server (moto) on 127.0.0.1; the cluster is
started once for this module (Ray's start-up is slow on 2 cores) and every command runs as the
user runs it, in a process of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support import free_port, read_terminal
from test_object_store import BUCKET, S3Server, _env, rlreplay, s3  # noqa: F401  (s3: a fixture)

SHOWCASE = Path(__file__).parents[2] / "sample_runs" / "verl-arith-smollm2"
PREFIX = "exp/showcase"
URI = f"s3://{BUCKET}/{PREFIX}"
#: A pattern the showcase run's decoded responses hold in some rollouts and not in others.
PATTERN = "^1"


@pytest.fixture(scope="module")
def showcase(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The showcase run uploaded to the store, byte for byte, and a local copy of it."""
    client = s3.client()
    for path in sorted(SHOWCASE.rglob("*")):
        if path.is_file():
            key = f"{PREFIX}/{path.relative_to(SHOWCASE).as_posix()}"
            client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())
    local = tmp_path_factory.mktemp("showcase") / "verl-arith-smollm2"
    shutil.copytree(SHOWCASE, local)
    return local


def _lines(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode in (0, 1), proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def _same(env: dict[str, str], local: Path, cwd: Path, command: list[str], *extra: str) -> tuple:
    """The command on the store's run (with ``extra`` options) and on the local copy: (remote, local)."""
    name, *rest = command
    remote = rlreplay(env, name, URI, *rest, *extra, cwd=cwd, timeout=300)
    here = rlreplay(env, name, str(local), *rest, cwd=cwd, timeout=300)
    return remote, here


#: Local commands run side by side (each a process of its own) where their answers are made once;
#: the --engine ray commands run one at a time (Ray drivers side by side only slow each other).
AT_ONCE = 2


def _at_once(calls: list[Callable[[], subprocess.CompletedProcess]]) -> list[subprocess.CompletedProcess]:
    """Each call (a command in a process of its own) run side by side: their results, in order."""
    with ThreadPoolExecutor(AT_ONCE) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_a_remote_run_keeps_its_tokenizer(s3: S3Server, showcase: Path, tmp_path: Path) -> None:
    """``ls --grep``, ``export`` and ``audit``'s garbled check decode a run on the store with the
    tokenizer files it keeps, fetched once into the read cache like its other files."""
    env = _env(s3, tmp_path)
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_HOME"] = str(tmp_path / "no-hub")  # the manifest's hub name is not on this machine
    remote, here = _same(env, showcase, tmp_path, ["ls", "--json", "--grep", PATTERN])
    assert remote.returncode == 0, remote.stderr
    found = _lines(remote)
    every = _lines(rlreplay(env, "ls", str(showcase), "--json", cwd=tmp_path))
    assert found == _lines(here) and 0 < len(found) < len(every)
    cached = next((tmp_path / "cache").glob(f"*/{Path(PREFIX).name}"))
    assert (cached / "tokenizer.json").read_bytes() == (SHOWCASE / "tokenizer.json").read_bytes()

    outs = []
    for where in (URI, str(showcase)):
        out = tmp_path / f"export-{len(outs)}.jsonl"
        proc = rlreplay(env, "export", where, "--out", str(out), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] and outs[0].count(b"\n") == len(every)

    remote, here = _same(env, showcase, tmp_path, ["audit", "--json", "--fail-on", "none"])
    assert remote.returncode == 0 and "garbled skipped" not in remote.stderr, remote.stderr
    assert _lines(remote) == _lines(here)


@pytest.fixture(scope="module")
def cluster(s3: S3Server, tmp_path_factory: pytest.TempPathFactory):
    """A real 3-node Ray cluster (one CPU each) with its dashboard (the state API), started once.
    Each node has the store's credentials and a read cache of its own, as separate machines do."""
    from ray.cluster_utils import Cluster

    base = tmp_path_factory.mktemp("nodes")

    def node_env(i: int) -> dict[str, str]:
        creds = {k: v for k, v in _env(s3, base).items() if k.startswith("AWS_")}
        own = {"RLREPLAY_CACHE": str(base / f"node-{i}" / "cache"), "XDG_CACHE_HOME": str(base / f"node-{i}")}
        return {**creds, **own, "RLREPLAY_HOST": f"node-{i}"}

    port = free_port()
    made = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": True,
            "dashboard_port": port,
            "env_vars": node_env(0),
        },
    )
    for i in (1, 2):
        made.add_node(num_cpus=1, env_vars=node_env(i))
    made.wait_for_nodes()
    made.dashboard = f"http://127.0.0.1:{port}"
    made.node_env = node_env
    try:
        yield made
    finally:
        made.shutdown()


#: The showcase run's steps are 44-57 KB of span files: parts of this size hold one whole step.
STEP_PART = 60_000
#: Parts of this size cut each step into 3-4 pieces.
CUT_PART = 14_000


def _ray_env(s3: S3Server, tmp: Path, cluster, part: int = STEP_PART) -> dict[str, str]:
    """The driver's environment: the cluster's address, parts of ``part`` bytes (default: one
    step each), a cache of its own."""
    return {**_env(s3, tmp), "RAY_ADDRESS": cluster.address, "RLREPLAY_PART_BYTES": str(part)}


def _drivers(cluster) -> set[str]:
    """The jobs of the drivers that ever connected to the cluster: a job each connection makes."""
    from ray.util.state import list_jobs

    jobs = list_jobs(address=cluster.dashboard, limit=10000, raise_on_missing_output=False)
    return {job.job_id for job in jobs if job.type == "DRIVER"}


def _tasks(cluster) -> list:
    from ray.util.state import list_tasks

    return list_tasks(
        address=cluster.dashboard, filters=[("func_or_class_name", "=", "run_part")], limit=10000, detail=True
    )


#: The commands that read every token, as the issue names them (export is checked apart: a file).
COMMANDS = [
    ["audit", "--json", "--fail-on", "none"],
    ["audit"],
    ["mismatch"],
    ["mismatch", "--json"],
    ["mismatch", "--json", "--by", "position"],
    ["ls", "--json", "--grep", PATTERN],
]


@pytest.fixture(scope="module")
def local_answers(s3: S3Server, showcase: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What each of ``COMMANDS`` and ``export`` answer with ``--engine local`` on the local copy
    (stdout, stderr, exit code; the exported file's bytes), made once: the local engine reads the
    run whole, whatever a part's size."""
    tmp = tmp_path_factory.mktemp("local")
    env = _env(s3, tmp)
    out = tmp / "export.jsonl"
    calls = [lambda c=c: rlreplay(env, c[0], str(showcase), *c[1:], cwd=tmp, timeout=300) for c in COMMANDS]
    calls.append(
        lambda: rlreplay(env, "export", str(showcase), "--out", str(out), "--logprobs", cwd=tmp, timeout=300)
    )
    *answers, exported = _at_once(calls)
    assert exported.returncode == 0, exported.stderr
    return {"commands": answers, "export": out.read_bytes()}


@pytest.mark.parametrize("part", [STEP_PART, CUT_PART])
def test_ray_engine_answers_as_the_local_one(
    s3: S3Server, showcase: Path, cluster, local_answers: dict, tmp_path: Path, part: int
) -> None:
    """Each command with --engine ray on the s3:// run equals the local command on a local copy:
    stdout, stderr and exit code; the tasks ran on more than one node; each command connected to
    the cluster once (audit too, whose mismatch check and trajectory checks both map parts). With
    parts of one step, and with parts smaller than a step: each step read as 3-4 tasks (but
    mismatch's), each reading only its trajectories' row groups (the local answers:
    ``local_answers``)."""
    from rlreplay.engine import plan
    from rlreplay.read.open import open_run

    run = open_run(showcase)
    steps = len(set(run.trajectories()["step"].to_pylist()))
    parts = plan(run, run.trajectories(), part)
    if part == CUT_PART:
        assert len(parts) >= 3 * steps and all(p.owner is not None for p in parts)
    else:
        assert len(parts) == steps and all(p.owner is None for p in parts)
    env = _ray_env(s3, tmp_path, cluster, part)
    before = {t.task_id for t in _tasks(cluster)}
    out = tmp_path / "export.jsonl"
    for command, here in zip(COMMANDS, local_answers["commands"], strict=True):  # one driver at a time
        name, *rest = command
        drivers = _drivers(cluster)
        remote = rlreplay(env, name, URI, *rest, "--engine", "ray", cwd=tmp_path, timeout=300)
        assert (remote.returncode, remote.stdout, remote.stderr) == (
            here.returncode,
            here.stdout,
            here.stderr,
        ), command
        assert remote.stdout.strip() and here.returncode in (0, 1), command
        assert len(_drivers(cluster) - drivers) == 1, command  # one connection
    drivers = _drivers(cluster)
    exported = rlreplay(
        env, "export", URI, "--out", str(out), "--logprobs", "--engine", "ray", cwd=tmp_path, timeout=300
    )
    assert exported.returncode == 0, exported.stderr
    assert len(_drivers(cluster) - drivers) == 1
    assert out.read_bytes() == local_answers["export"] and local_answers["export"].count(b"\n") == 200
    ours = [t for t in _tasks(cluster) if t.task_id not in before]
    # audit twice, mismatch three times, ls --grep and export: a task a part each (and audit's
    # mismatch check's)
    assert len(ours) >= 7 * len(parts) and {t.state for t in ours} == {"FINISHED"}
    assert len({t.node_id for t in ours}) >= 2


def test_export_grep_connects_once(s3: S3Server, showcase: Path, cluster, tmp_path: Path) -> None:
    """``export --grep`` with --engine ray searches the parts on the cluster, then exports the
    chosen trajectories' parts there: both on one connection (one driver job), and the file and
    what is said are the local command's on a local copy."""
    env = _ray_env(s3, tmp_path, cluster)
    said = {}
    for where, engine in ((URI, ["--engine", "ray"]), (str(showcase), [])):
        out = tmp_path / f"export-{len(said)}.jsonl"
        drivers = _drivers(cluster)
        proc = rlreplay(
            env, "export", where, "--grep", PATTERN, "--out", str(out), *engine, cwd=tmp_path, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        assert len(_drivers(cluster) - drivers) == (1 if engine else 0)
        said[where] = (proc.stdout, proc.stderr.replace(str(out), "OUT"), out.read_bytes())
    remote, here = said[URI], said[str(showcase)]
    assert remote == here and 0 < here[2].count(b"\n") < 200


#: What the damaged-file test asks: (command, its options).
DAMAGED_COMMANDS = [["audit", "--json"], ["mismatch", "--json"]]


@pytest.fixture(scope="module")
def damaged(s3: S3Server, showcase: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A copy of the showcase run with one shard of step 3 damaged (a byte flipped: its checksums
    no longer match), that shard, and what ``DAMAGED_COMMANDS`` answer on it with ``--engine
    local`` (the same for every part size: the local engine reads the run whole), made once."""
    tmp = tmp_path_factory.mktemp("damaged")
    copy = tmp / "damaged"
    shutil.copytree(showcase, copy)
    shard = sorted(copy.glob("spans/step=3/*/*.parquet"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    env = _env(s3, tmp)
    calls = [
        lambda c=c: rlreplay(env, c[0], str(copy), *c[1:], cwd=tmp, timeout=300) for c in DAMAGED_COMMANDS
    ]
    return copy, shard, _at_once(calls)


@pytest.mark.parametrize("part", [STEP_PART, CUT_PART])
def test_ray_engine_warns_of_damaged_files_as_the_local_one(
    s3: S3Server, cluster, damaged: tuple, tmp_path: Path, part: int
) -> None:
    """A shard whose bytes no longer match its checksums: the same warning, the same "not in
    full" line and exit code 2 from the tasks as from the local reader, with whole steps a task
    and with steps cut into pieces (every piece verifies the file whole)."""
    copy, shard, local = damaged
    client = s3.client()
    for path in sorted(copy.rglob("*")):
        if path.is_file() and not path.relative_to(copy).as_posix().startswith("_run_index"):
            key = f"exp/damaged-{part}/{path.relative_to(copy).as_posix()}"
            client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())
    env = _ray_env(s3, tmp_path, cluster, part)
    uri = f"s3://{BUCKET}/exp/damaged-{part}"
    codes = {}
    for command, here in zip(DAMAGED_COMMANDS, local, strict=True):
        remote = rlreplay(env, command[0], uri, *command[1:], "--engine", "ray", cwd=tmp_path, timeout=300)
        said = remote.stderr.replace(uri, str(copy))  # the run named where it is
        assert (remote.returncode, remote.stdout, said) == (here.returncode, here.stdout, here.stderr)
        assert shard.name in remote.stderr and "could not be read in full" in remote.stderr
        codes[command[0]] = remote.returncode
    assert codes == {"audit": 2, "mismatch": 0}  # mismatch: the figures of what could be read


def test_a_node_lost_mid_scan_leaves_the_answer_unchanged(
    s3: S3Server, cluster, local_answers: dict, tmp_path: Path
) -> None:
    """A fourth node joins; once a task runs there, the node is removed (its processes killed):
    Ray runs the task again elsewhere and the answer is the local one."""
    env = _ray_env(s3, tmp_path, cluster)
    assert COMMANDS[0] == ["audit", "--json", "--fail-on", "none"]
    expected = local_answers["commands"][0]  # the local command's answer on the local copy
    retried = False
    for _ in range(3):  # a task caught running may still end before its node goes: then try again
        retried = _lose_a_node_mid_scan(env, cluster, tmp_path, expected)
        if retried:
            break
    assert retried, "no task caught on the removed node ran again"


def _lose_a_node_mid_scan(env: dict[str, str], cluster, tmp_path: Path, expected) -> bool:
    """Remove a fourth node while the scan runs a task there; the answer must be the local one.
    True when that task ran again (it had not ended before its node went)."""
    node = cluster.add_node(num_cpus=1, env_vars=cluster.node_env(3))
    cluster.wait_for_nodes()
    before = {t.task_id for t in _tasks(cluster)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "audit", URI, "--json", "--fail-on", "none", "--engine", "ray"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        caught = None
        while caught is None and time.monotonic() < deadline and proc.poll() is None:
            for task in _tasks(cluster):
                if task.task_id not in before and task.node_id == node.node_id and task.state != "FINISHED":
                    caught = task
            time.sleep(0.1)
        assert caught is not None, "no task ran on the fourth node"
        cluster.remove_node(node, allow_graceful=False)
        _wait_until_dead(cluster, node.node_id)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, out) == (expected.returncode, expected.stdout)
    # rlreplay says what it said locally; Ray's own note of the lost node may come beside it
    assert [line for line in err.splitlines() if line.startswith("rlreplay")] == expected.stderr.splitlines()
    again = [t for t in _tasks(cluster) if t.task_id == caught.task_id]
    return max(t.attempt_number for t in again) >= 1  # the lost task ran again


def _wait_until_dead(cluster, node_id: str) -> None:
    """Until the cluster has marked the removed node dead: Ray tells every driver connected at that
    moment (a "(raylet)" line on its stderr), which must be this test's and not the next one's."""
    from ray.util.state import list_nodes

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        states = {n.node_id: n.state for n in list_nodes(address=cluster.dashboard, limit=1000)}
        if states.get(node_id) == "DEAD":
            return
        time.sleep(0.5)
    raise AssertionError(f"node {node_id} was never marked dead")


def test_a_progress_bar_on_a_terminal_only(s3: S3Server, showcase: Path, cluster, tmp_path: Path) -> None:
    """stderr a terminal: the driver draws the parts done; a pipe (the tests above): nothing."""
    import pty

    env = _ray_env(s3, tmp_path, cluster)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "mismatch", URI, "--json", "--engine", "ray"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=follower,
    )
    os.close(follower)
    drawn = read_terminal(leader)
    out, _ = proc.communicate(timeout=300)
    os.close(leader)
    assert proc.returncode == 0 and out.count(b"\n") == 6
    assert b"mismatch [" in drawn and b"] 6/6 parts" in drawn, drawn[-500:]


#: A step of one response far off (every token |Δ| ≥ 3) beside many close ones, a sample each.
FAR_TOKENS, CLOSE_TOKENS, CLOSE_SAMPLES = 40, 200, 20


def _record_far_and_close(run_dir: Path) -> list[float]:
    """Record the step (and a step 1 of three close samples); every counted |Δ| of step 0, as
    recorded (float32 log-probs, their difference in float64)."""
    import asyncio

    import numpy as np

    import rlreplay
    from rlreplay.recorder.signals import record_signals

    rng = np.random.default_rng(5)

    @rlreplay.trace_op(name="AgentLoop.run", kind="agent")
    async def agent(ids: list[int], rollout: list[float]) -> dict:
        return {"response_ids": ids, "response_mask": [1] * len(ids), "response_logprobs": rollout}

    async def one(step: int, sample: int, n: int, off: float) -> list[float]:
        rollout = np.float32(-rng.random(n) * 3)
        trainer = np.float32(rollout + off + rng.normal(0, 0.02, n))
        async with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=0) as traj:
            await agent(list(range(100, 100 + n)), [float(v) for v in rollout])
        record_signals(
            traj.id, step=step, sample_index=sample, rollout_n=0, validate=False,
            output={"old_log_probs": [float(v) for v in trainer]},
        )  # fmt: skip
        return np.abs(trainer.astype(np.float64) - rollout.astype(np.float64)).tolist()

    rlreplay.init(run_dir, worker="w0")
    gaps = asyncio.run(one(0, 0, FAR_TOKENS, 3.0))
    for sample in range(1, CLOSE_SAMPLES + 1):
        gaps += asyncio.run(one(0, sample, CLOSE_TOKENS, 0.0))
    for sample in range(3):
        asyncio.run(one(1, sample, CLOSE_TOKENS, 0.0))
    rlreplay.close()
    return gaps


def test_mismatch_pieces_that_kept_too_few_of_a_step_are_made_again(
    s3: S3Server, cluster, tmp_path: Path
) -> None:
    """A piece a sample: the far response's piece keeps fewer of its |Δ| than the step's p99
    reads of it, so the step's pieces are made again keeping enough; ``mismatch`` (printed and
    --json) equals the local command's, the p99 numpy's over every |Δ| of the step."""
    import numpy as np
    import pyarrow as pa

    from rlreplay.engine import plan
    from rlreplay.format import arrow_ops as ops
    from rlreplay.mismatch.report import LISTING_COLUMNS, digest, kept_too_few
    from rlreplay.mismatch.tokens import Counts
    from rlreplay.read.open import open_run

    run_dir = tmp_path / "run"
    gaps = _record_far_and_close(run_dir)
    run = open_run(run_dir)
    listing = run.trajectories().select(LISTING_COLUMNS)
    parts = plan(run, listing, 1)
    first = [p for p in parts if listing["step"][int(p.rows[0])].as_py() == 0]
    assert len(first) == CLOSE_SAMPLES + 1 and all(p.owner is not None for p in first)
    made = [
        piece
        for p in first
        for piece in digest(run, ops.take(listing, pa.array(p.rows)), "step", None, Counts(), keep=0)
    ]
    assert kept_too_few(made) > 0  # what the pieces keep at first is not enough here
    env = _ray_env(s3, tmp_path, cluster, 1)
    before = {t.task_id for t in _tasks(cluster)}
    for command in (["mismatch", "--json"], ["mismatch"]):
        name, *rest = command
        remote = rlreplay(env, name, str(run_dir), *rest, "--engine", "ray", cwd=tmp_path, timeout=300)
        here = rlreplay(env, name, str(run_dir), *rest, cwd=tmp_path, timeout=300)
        assert (remote.returncode, remote.stdout, remote.stderr) == (
            here.returncode,
            here.stdout,
            here.stderr,
        )
        assert here.returncode in (0, 1) and here.stdout.strip()
        if "--json" in command:
            rows = [r for r in _lines(here) if r.get("step") == 0 and "logprob_diff_p99" in r]
            assert [r["logprob_diff_p99"] for r in rows] == [float(np.percentile(gaps, 99))]
    ours = [t for t in _tasks(cluster) if t.task_id not in before]
    # each command: a task a part, and the step's pieces once more
    assert len(ours) >= 2 * (len(parts) + len(first))
