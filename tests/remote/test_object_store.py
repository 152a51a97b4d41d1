"""Runs on an object store, against a real S3 server (moto) on 127.0.0.1, and on a multi-node Ray cluster.

The server runs with IAM authentication on (after the few setup calls), so wrong credentials are
really refused. Outages are made with a loopback TCP forwarder in front of it (moto keeps objects
in memory: it is never restarted). The Ray test starts a real 3-node cluster on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import Forwarder, free_port, rlreplay_proc, wait_port

SCRIPTS = Path(__file__).parents[1] / "node_scripts"
BUCKET = "rlreplay-runs"


@dataclass
class S3Server:
    endpoint: str
    key: str
    secret: str
    port: int

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
        )

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """moto_server with IAM auth enforced after 3 setup calls (a user, its policy, its access key)."""
    import boto3

    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")  # noqa: SIM115
    moto = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_port(port)
        endpoint = f"http://127.0.0.1:{port}"
        anon = {"endpoint_url": endpoint, "region_name": "us-east-1"}
        iam = boto3.client("iam", aws_access_key_id="setup", aws_secret_access_key="setup", **anon)
        iam.create_user(UserName="recorder")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="recorder", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="recorder")["AccessKey"]
        server = S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], port)
        server.client().create_bucket(Bucket=BUCKET)
        yield server
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _env(s3: S3Server, tmp: Path, endpoint: str | None = None, secret: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RLREPLAY_"))}
    env.update(
        AWS_ENDPOINT_URL=endpoint or s3.endpoint,
        AWS_ACCESS_KEY_ID=s3.key,
        AWS_SECRET_ACCESS_KEY=secret or s3.secret,
        AWS_DEFAULT_REGION="us-east-1",
        RLREPLAY_SPOOL=str(tmp / "spool"),
        RLREPLAY_CACHE=str(tmp / "cache"),
        RLREPLAY_PUBLISH_INTERVAL_S="0.2",
    )
    return env


def rlreplay(env: dict[str, str], *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return rlreplay_proc(*args, env=env, inherit=False, cwd=cwd, timeout=timeout)


def ls_json(env: dict[str, str], run: str, *args: str, cwd: Path) -> list[dict]:
    proc = rlreplay(env, "ls", run, "--json", *args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


JOB = textwrap.dedent(
    """
    import sys
    import rlreplay

    @rlreplay.trace_op(kind="llm", name="Model.generate")
    def generate(prompt_ids):
        return {"token_ids": [t + 1 for t in prompt_ids]}

    for step in range(int(sys.argv[1])):
        for sample in range(4):
            for n in range(2):
                with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=n):
                    generate(list(range(sample, sample + 16)))
    """
)


def test_record_list_show_read_only_what_is_needed(s3: S3Server, tmp_path: Path) -> None:
    env = _env(s3, tmp_path)
    uri = f"s3://{BUCKET}/exp/run1"
    proc = rlreplay(env, "record", "--out", uri, "--", sys.executable, "-c", JOB, "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "3 steps, 24 trajectories" in proc.stderr
    assert not (tmp_path / "s3:").exists()  # a URI is never taken for a local path
    keys = s3.keys("exp/run1/")
    shards = [k for k in keys if k.endswith(".parquet")]
    assert len(shards) == 3 and all("/spans/step=" in k for k in shards)
    assert "exp/run1/run.json" in keys
    assert not [k for k in keys if k.endswith(".partial") or "_lease-" in k or ".tmp" in k]
    body = b"".join(s3.client().get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys)
    assert s3.secret.encode() not in body and s3.key.encode() not in body
    manifest = json.loads(s3.client().get_object(Bucket=BUCKET, Key="exp/run1/run.json")["Body"].read())
    assert (manifest["status"], manifest["trajectories"], manifest["lost"]) == ("finished", 24, 0)
    assert not list((tmp_path / "spool").glob("*/*/spans"))  # every spool was published and removed

    fresh = {**env, "RLREPLAY_CACHE": str(tmp_path / "cache-step")}
    rows = ls_json(fresh, uri, "--step", "1", cwd=tmp_path)
    assert len(rows) == 8 and {r["step"] for r in rows} == {1}
    fetched = {p.name for p in (tmp_path / "cache-step").glob("*/run1/spans/*")}
    assert fetched == {"step=1"}  # only that step's objects were fetched

    assert len(ls_json(env, uri, cwd=tmp_path)) == 24
    show = rlreplay(env, "show", rows[0]["id"], "--run", uri, cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    assert "Model.generate" in show.stdout
    info = rlreplay(env, "info", uri, "--json", cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    summary = json.loads(info.stdout)
    assert (summary["steps"], summary["trajectories"], summary["upload_errors"]) == (3, 24, 0)
    assert summary["run"] == uri  # the run, not the local cache it is read through
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix="exp/run1/spans/")["Contents"]
    assert summary["bytes_on_disk"] == sum(o["Size"] for o in listed)  # what the store holds

    again = rlreplay(env, "record", "--out", uri, "--", sys.executable, "-c", JOB, "1", cwd=tmp_path)
    assert again.returncode == 2 and "never overwritten" in again.stderr


def test_replay_serves_from_a_run_on_the_store(s3: S3Server, tmp_path: Path) -> None:
    """``rlreplay replay s3://...``: every process of the job reads the source from the store (not
    from the local cache the command looked at), and the new run's manifest names the URI."""
    env = _env(s3, tmp_path)
    uri = f"s3://{BUCKET}/exp/replayed"
    job = [sys.executable, str(Path(__file__).parents[1] / "replay_job.py")]
    config = json.dumps({"steps": 2, "samples": 2, "rollouts": 2, "seed": 0, "spawn": True})
    proc = rlreplay(env, "record", "--framework", "generic", "--out", uri, "--", *job, config, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    calls = sum(r["model_calls"] for r in ls_json(env, uri, cwd=tmp_path))
    assert calls > 0
    down = {**env, "REPLAY_JOB_ENGINE_DOWN": "1"}  # a model call that is not served fails the job
    args = ("replay", uri, "--framework", "generic", "--out", str(tmp_path / "new"), "--", *job, config)
    proc = rlreplay(down, *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"{calls} ops served; 0 trajectories diverged" in proc.stderr
    manifest = json.loads((tmp_path / "new" / "run.json").read_text())
    assert manifest["replay"]["source"] == uri


def test_a_source_whose_objects_are_removed_during_the_replay_is_not_silent(
    s3: S3Server, tmp_path: Path
) -> None:
    """The job's process reads the source when its first trajectory opens; the store's objects are
    gone by then: under ``--on-diverge fail`` the command exits non-zero, the summary names the URI
    as given, and every trajectory says why it was not served."""
    env = _env(s3, tmp_path)
    uri = f"s3://{BUCKET}/exp/goes-away"
    job = [sys.executable, str(Path(__file__).parents[1] / "replay_job.py")]
    config = {"steps": 2, "samples": 2, "rollouts": 1, "seed": 0}
    framework = ("--framework", "generic")
    proc = rlreplay(env, "record", *framework, "--out", uri, "--", *job, json.dumps(config), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    recorded = ls_json(env, uri, cwd=tmp_path)
    assert s3.keys("exp/goes-away/")
    args = ("replay", uri, *framework, "--on-diverge", "fail", "--out", str(tmp_path / "new"))
    proc = rlreplay(env, *args, "--", *job, json.dumps({**config, "remove": uri}), cwd=tmp_path)
    assert not s3.keys("exp/goes-away/"), proc.stderr
    assert proc.returncode != 0
    summary = proc.stderr[proc.stderr.index("rlreplay: replay of ") :]
    assert summary.startswith(f"rlreplay: replay of {uri}: 0 ops served")
    assert f"{len(recorded)} trajectories were not served: the source run could not be read" in summary
    rows = ls_json(env, str(tmp_path / "new"), cwd=tmp_path)
    assert len(rows) == len(recorded)
    for row in rows:
        assert row["replay"] == "diverged" and row["replay_reason"].startswith(
            "the source run could not be read"
        )


KILLED = textwrap.dedent(
    """
    import time
    import rlreplay

    for step, samples in ((0, 3), (1, 2)):
        for sample in range(samples):
            with rlreplay.trajectory(step=step, sample_index=sample):
                pass
    assert rlreplay.flush()
    print("ACK", flush=True)
    time.sleep(600)
    """
)


def test_recover_pushes_what_a_killed_process_left_in_its_spool(s3: S3Server, tmp_path: Path) -> None:
    env = _env(s3, tmp_path)
    uri = f"s3://{BUCKET}/exp/killed"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED], env={**env, "RLREPLAY_DIR": uri}, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ACK"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert [k for k in s3.keys("exp/killed/spans/") if "step=1" in k] == []  # step 1 was still live
    (spool,) = (tmp_path / "spool").glob("*/*/spans")

    proc = rlreplay(env, "recover", uri, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "recovered 1 shard (2 spans)" in proc.stdout
    rows = ls_json(env, uri, cwd=tmp_path)
    assert sorted((r["step"], r["sample_index"]) for r in rows) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert not spool.exists()  # published, then removed from the spool


STEPPED = textwrap.dedent(
    """
    import json, sys
    import rlreplay
    from rlreplay.remote import location
    from rlreplay.remote import publish

    for line in sys.stdin:
        step = int(line)
        for sample in range(4):
            with rlreplay.trajectory(step=step, sample_index=sample):
                pass
        assert rlreplay.flush()
        print("STEP", step, flush=True)
    rlreplay.close()
    print("STATS " + json.dumps(publish.upload_stats().__dict__), flush=True)
    """
)


def test_store_outage_while_recording_loses_nothing(s3: S3Server, tmp_path: Path) -> None:
    forwarder = Forwarder(s3.port)
    forwarder.start()
    env = _env(s3, tmp_path, endpoint=f"http://127.0.0.1:{forwarder.port}")
    uri = f"s3://{BUCKET}/exp/outage"
    child = subprocess.Popen(
        [sys.executable, "-c", STEPPED],
        env={**env, "RLREPLAY_DIR": uri},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None

    def step(k: int) -> None:
        child.stdin.write(f"{k}\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["STEP", str(k)]

    def wait_for_shard(k: int) -> None:
        deadline = time.monotonic() + 30
        while not [key for key in s3.keys(f"exp/outage/spans/step={k}/") if key.endswith(".parquet")]:
            assert time.monotonic() < deadline, f"step {k} never published"
            time.sleep(0.1)

    try:
        step(0)
        step(1)  # seals step 0
        wait_for_shard(0)
        forwarder.stop()  # the store is unreachable
        for k in (2, 3, 4):  # recording goes on; sealed steps 1..3 wait in the spool
            step(k)
        time.sleep(1.5)  # several failed uploads, retried with backoff
        assert s3.keys("exp/outage/spans/step=2/") == []
        sealed_waiting = list((tmp_path / "spool").glob("*/*/spans/step=*/worker=*/part-*.parquet"))
        assert len(sealed_waiting) >= 2
        forwarder.start()
        step(5)
        child.stdin.close()
        stats = json.loads(child.stdout.readline().removeprefix("STATS "))
        assert child.wait(60) == 0
    finally:
        forwarder.stop()
        if child.poll() is None:
            child.kill()
    assert stats["upload_errors"] > 0 and stats["pending"] == 0, stats
    rows = ls_json(_env(s3, tmp_path), uri, cwd=tmp_path)
    assert sorted((r["step"], r["sample_index"]) for r in rows) == [
        (k, s) for k in range(6) for s in range(4)
    ]
    info = json.loads(rlreplay(_env(s3, tmp_path), "info", uri, "--json", cwd=tmp_path).stdout)
    assert info["upload_errors"] == stats["upload_errors"] and info["lost"] == 0


def test_bad_bucket_and_credentials(s3: S3Server, tmp_path: Path) -> None:
    env = _env(s3, tmp_path)
    missing = rlreplay(env, "ls", "s3://no-such-bucket-here/run", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1 and "no bucket 'no-such-bucket-here'" in missing.stderr

    wrong = "WRONGsecretWRONGsecret0123"
    bad = _env(s3, tmp_path, secret=wrong)
    uri = f"s3://{BUCKET}/exp/badcreds"
    for command in (["ls", uri], ["info", uri], ["show", "abc", "--run", uri]):
        proc = rlreplay(bad, *command, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert "ACCESS_DENIED" in proc.stderr or "denied" in proc.stderr.lower()
        assert wrong not in proc.stderr

    # Recording goes on with bad credentials: everything waits in the spool, and says so. (Uploads
    # refused for bad credentials never succeed: a closing process retries them 1 s, not 30.)
    closing_1s = {**bad, "RLREPLAY_UPLOAD_TIMEOUT_S": "1"}
    proc = rlreplay(
        closing_1s, "record", "--out", uri, "--grace", "1", "--", sys.executable, "-c", JOB, "2", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "wait in" in proc.stderr and f"rlreplay recover {uri}" in proc.stderr
    assert wrong not in proc.stderr and s3.keys("exp/badcreds/") == []
    fixed = rlreplay(env, "recover", uri, cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr
    assert len(ls_json(env, uri, cwd=tmp_path)) == 16
    manifest = json.loads(s3.client().get_object(Bucket=BUCKET, Key="exp/badcreds/run.json")["Body"].read())
    assert manifest["status"] == "finished" and "-c" in manifest["command"]  # the driver's, pushed late


@pytest.fixture(scope="module")
def ray_cluster(s3: S3Server, tmp_path_factory: pytest.TempPathFactory):
    """A real 3-node Ray cluster on this machine; each node has its own simulated host name and,
    like a real node, the store's credentials in its own environment (rlreplay never ships them)."""
    from ray.cluster_utils import Cluster

    def node_env(i: int) -> dict[str, str]:
        creds = {k: v for k, v in _env(s3, tmp_path_factory.getbasetemp()).items() if k.startswith("AWS_")}
        return {**creds, "RLREPLAY_HOST": f"node-{i}"}

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "env_vars": node_env(0)},
    )
    for i in (1, 2):
        cluster.add_node(num_cpus=1, env_vars=node_env(i))
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_ray_cluster_of_three_nodes_records_into_one_run(s3: S3Server, ray_cluster, tmp_path: Path) -> None:
    env = _env(s3, tmp_path)
    job = [sys.executable, str(SCRIPTS / "ray_multinode.py"), ray_cluster.address, "2", "3"]
    shared = tmp_path / "shared" / "run"  # a folder every node sees (a shared filesystem)
    for out in (f"s3://{BUCKET}/exp/ray", str(shared)):
        proc = rlreplay(env, "record", "--out", out, "--", *job, cwd=tmp_path, timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "DONE" in proc.stdout
        actors = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("ACTORS "))[7:])
        assert len({a["node"] for a in actors}) == 3 and {a["host"] for a in actors} == {
            "node-0",
            "node-1",
            "node-2",
        }
        assert "2 steps, 18 trajectories" in proc.stderr  # the driver's summary counts every node
        assert "recovered shards 0" in proc.stderr  # each node sealed and published its own files
        rows = ls_json(env, out, cwd=tmp_path)
        by_worker: dict[str, int] = {}
        for row in rows:
            by_worker[row["worker"]] = by_worker.get(row["worker"], 0) + 1
        assert by_worker == {a["worker"]: 6 for a in actors}


def test_a_uri_is_never_a_local_path() -> None:
    from rlreplay.remote.location import as_uri, local_path, redact

    assert as_uri(Path("s3://bucket/p/run")) == "s3://bucket/p/run"  # a Path folds "//" into "/"
    assert as_uri("gs://bucket/run") == "gs://bucket/run"
    assert as_uri("/data/run") is None and as_uri("runs/r1") is None and as_uri("C:/x") is None
    assert as_uri("file:///data/run") is None and local_path("file:///data/run") == Path("/data/run")
    shown = redact("s3://user:pw123@bucket/run?secret_key=abc123&region=x")
    assert "pw123" not in shown and "abc123" not in shown and "region=x" in shown


def test_any_fsspec_filesystem_goes_through_the_same_layer(tmp_path: Path, monkeypatch) -> None:
    """fsspec's in-memory filesystem (no pyarrow native one): record, publish (temp name + move),
    read back only one step."""
    import fsspec

    import rlreplay
    from rlreplay.remote import location

    monkeypatch.setenv("RLREPLAY_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("RLREPLAY_CACHE", str(tmp_path / "cache"))
    uri = f"memory://runs/{tmp_path.name}"
    rlreplay.init(uri)
    try:
        for step in range(3):
            for sample in range(2):
                with rlreplay.trajectory(step=step, sample_index=sample):
                    pass
    finally:
        rlreplay.close()
    files = fsspec.filesystem("memory").find(f"/runs/{tmp_path.name}")
    assert len([f for f in files if f.endswith(".parquet")]) == 3
    assert not [f for f in files if f.rsplit("/", 1)[1].startswith("_")]  # no temp name, no lease left
    assert not list((tmp_path / "spool").glob("*/*/spans"))
    run = rlreplay.open_run(uri)
    assert sorted(run.trajectories(step=1)["sample_index"].to_pylist()) == [0, 1]
    assert {p.name for p in (tmp_path / "cache").glob("*/*/spans/*")} == {"step=1"}
    assert len(run.trajectories()) == 6 and location.as_uri(uri) == uri


def test_a_sealed_shard_is_published_right_after_sealing(tmp_path: Path, monkeypatch) -> None:
    """The publisher uploads a shard when it is sealed, not on its next timed round."""
    import fsspec

    import rlreplay

    monkeypatch.setenv("RLREPLAY_SPOOL", str(tmp_path / "spool"))
    monkeypatch.setenv("RLREPLAY_PUBLISH_INTERVAL_S", "600")  # no timed round during the test
    root = f"/runs/{tmp_path.name}-sealed"
    rlreplay.init(f"memory:/{root}")
    try:
        for step in range(2):
            with rlreplay.trajectory(step=step, sample_index=0):
                pass
        assert rlreplay.flush()  # seals step 0
        deadline = time.monotonic() + 10
        while not [f for f in fsspec.filesystem("memory").find(root) if f.endswith(".parquet")]:
            assert time.monotonic() < deadline, "step 0 was sealed but not published"
            time.sleep(0.05)
    finally:
        rlreplay.close()


# ---- reading a remote run: listings fetch the shards' index files only ---------------------------

WORKER_JOB = textwrap.dedent(
    """
    import sys
    import rlreplay

    @rlreplay.trace_op(kind="llm", name="Model.generate")
    def generate(prompt_ids):
        return {"token_ids": [t + 1 for t in prompt_ids]}

    first, last, samples = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    for step in range(first, last):
        for sample in samples:
            with rlreplay.trajectory(step=step, sample_index=int(sample), rollout_n=0):
                generate(list(range(int(sample), int(sample) + 64)))
    """
)


def _record_worker(env: dict[str, str], uri: str, first: int, last: int, samples: str, cwd: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WORKER_JOB, str(first), str(last), samples],
        env={**env, "RLREPLAY_DIR": uri},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def _mirror(s3: S3Server, prefix: str, dest: Path) -> None:
    """A local copy of a run's manifest and span files (as the store holds them, byte for byte)."""
    client = s3.client()
    for key in s3.keys(prefix):
        if not key[len(prefix) :].startswith(("spans/", "run.json")) or key.endswith("/"):
            continue
        target = dest / key[len(prefix) :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())


def _json_lines(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def is_cached(cache: Path, suffix: str) -> list[str]:
    return sorted(
        p.relative_to(next(cache.glob("*/*"))).as_posix() for p in cache.glob(f"*/*/spans/**/*{suffix}")
    )


@pytest.fixture(scope="module")
def two_worker_run(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A run of 16 steps written by two processes (32 shards: a run index is kept), on the store."""
    tmp = tmp_path_factory.mktemp("two-workers")
    env = _env(s3, tmp)
    uri = f"s3://{BUCKET}/exp/listed"
    _record_worker(env, uri, 0, 16, "0,1", tmp)
    _record_worker(env, uri, 0, 16, "2,3", tmp)
    assert len([k for k in s3.keys("exp/listed/spans/") if k.endswith(".parquet")]) == 32
    return uri, tmp


def _listed_copy(
    s3: S3Server, run: tuple[str, Path], tmp_path: Path
) -> tuple[str, Path, dict[str, str], Path]:
    """(the run's URI, a local copy of it, the environment to read it, the cache that fills)."""
    local = tmp_path / "local-copy"
    _mirror(s3, "exp/listed/", local)
    return run[0], local, _env(s3, tmp_path), tmp_path / "cache"


def test_listing_a_remote_run_fetches_only_index_files(
    s3: S3Server, two_worker_run: tuple[str, Path], tmp_path: Path
) -> None:
    uri, local, env, cache = _listed_copy(s3, two_worker_run, tmp_path)
    commands = [
        ["ls", "--json"],
        ["stats", "--json"],
        ["ls", "--json", "--where", "sample_index >= 1 and model_calls = 1", "--sort", "step desc"],
        ["ls", "--json", "--step", "3..5,9"],
    ]
    for command in commands:
        remote = _json_lines(rlreplay(env, command[0], uri, *command[1:], cwd=tmp_path))
        expected = _json_lines(rlreplay(env, command[0], str(local), *command[1:], cwd=tmp_path))
        assert remote == expected and remote, command
        assert is_cached(cache, ".parquet") == [], command  # no shard was fetched
    query = (
        "SELECT step, count(*) AS n, sum(model_calls) AS calls FROM trajectories GROUP BY step ORDER BY step"
    )
    remote = _json_lines(rlreplay(env, "sql", query, "--run", uri, "--json", cwd=tmp_path))
    assert remote == _json_lines(rlreplay(env, "sql", query, "--run", str(local), "--json", cwd=tmp_path))
    assert len(remote) == 16 and is_cached(cache, ".parquet") == []
    info = json.loads(rlreplay(env, "info", uri, "--json", cwd=tmp_path).stdout)
    local_info = json.loads(rlreplay(env, "info", str(local), "--json", cwd=tmp_path).stdout)
    counts = ("steps", "trajectories", "spans", "token_ids")
    assert [info[k] for k in counts] == [local_info[k] for k in counts] == [16, 64, 128, 64 * 128]
    assert is_cached(cache, ".parquet") == []  # its span counts read the metadata columns in place
    listed = [k for k in s3.keys("exp/listed/spans/") if k.endswith(".index")]
    assert len(is_cached(cache, ".index")) == len(listed) == 32
    assert len(_json_lines(rlreplay(env, "ls", uri, "--json", cwd=tmp_path))) == 64
    assert list(cache.glob("*/*/_run_index/*.index"))  # the run index, kept in the cache

    rows = _json_lines(rlreplay(env, "ls", uri, "--json", "--step", "7", "--sample-index", "3", cwd=tmp_path))
    show = rlreplay(env, "show", rows[0]["id"], "--run", uri, "--json", "--no-text", cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout)["id"] == rows[0]["id"]
    expected = rlreplay(env, "show", rows[0]["id"], "--run", str(local), "--json", "--no-text", cwd=tmp_path)
    assert json.loads(show.stdout)["spans"] == json.loads(expected.stdout)["spans"]
    (holder,) = is_cached(cache, ".parquet")  # only the shard holding it, not its step's other one
    assert holder.startswith("spans/step=7/") and (local / holder).exists()
    import pyarrow.parquet as pq

    assert (
        rows[0]["id"] in pq.read_table(local / holder, columns=["trajectory_id"])["trajectory_id"].to_pylist()
    )
    assert len(list(local.glob("spans/step=7/*/*.parquet"))) == 2


def test_a_shard_published_after_a_listing_appears_in_the_next(
    s3: S3Server, two_worker_run: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, _ = two_worker_run
    env = _env(s3, tmp_path)
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.setenv("RLREPLAY_CACHE", env["RLREPLAY_CACHE"])
    from rlreplay.read.open import open_run

    later = uri + "-later"
    _record_worker(env, later, 0, 2, "0,1", tmp_path)
    from rlreplay.ui.data import RunView

    run = open_run(later)  # a long-lived reader, like the UI
    view = RunView(open_run(later))
    assert len(run.trajectories()) == 4 and len(view.listing()) == 4
    assert len(_json_lines(rlreplay(env, "ls", later, "--json", cwd=tmp_path))) == 4
    _record_worker(env, later, 2, 3, "0,1,2", tmp_path)  # a new shard on the store
    # the UI's listing, kept until the run changes, sees it (at once, or from a background
    # re-read when the first listing was slow)
    deadline = time.monotonic() + 60
    while len(view.listing()) != 7 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(view.listing()) == 7
    assert sorted(run.trajectories()["step"].to_pylist()) == [0, 0, 1, 1, 2, 2, 2]
    assert len(run.trajectories(step=2)) == 3
    assert len(_json_lines(rlreplay(env, "ls", later, "--json", cwd=tmp_path))) == 7
    assert is_cached(tmp_path / "cache", ".parquet") == []


def test_the_ui_serves_a_run_on_the_store_as_it_serves_a_copy(
    s3: S3Server, two_worker_run: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import re

    from starlette.testclient import TestClient

    from rlreplay.ui.app import create_app

    uri, local, env, _ = _listed_copy(s3, two_worker_run, tmp_path)
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.setenv("RLREPLAY_CACHE", env["RLREPLAY_CACHE"])
    ids = sorted(r["id"] for r in _json_lines(rlreplay(env, "ls", str(local), "--json", cwd=tmp_path)))
    assert len(ids) == 64

    def served(root: str) -> tuple[list[str], str]:
        with TestClient(create_app(root)) as client:
            first = client.get("/")  # a single run: its overview
            assert first.status_code == 200, first.text
            base = first.url.path  # /r/NAME/
            listed = client.get(f"{base}trajectories")
            assert listed.status_code == 200, listed.text
            one = client.get(f"{base}t/{ids[5]}")
            assert one.status_code == 200, one.text
        return sorted(set(re.findall(r"/t/([0-9a-f]{32})", listed.text))), one.text

    remote_ids, remote_page = served(uri)
    local_ids, _ = served(str(local))
    assert remote_ids == local_ids == ids
    assert ids[5] in remote_page and "Model.generate" in remote_page


def test_the_ui_names_a_missing_run_on_the_store_in_one_line(s3: S3Server, tmp_path: Path) -> None:
    env = _env(s3, tmp_path)
    proc = rlreplay(env, "ui", f"s3://{BUCKET}/exp/no-such-run", "--port", "0", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"rlreplay: error: no run at s3://{BUCKET}/exp/no-such-run (no run.json and no spans/)"
    ]


def test_concurrent_listings_share_one_cache(
    s3: S3Server, two_worker_run: tuple[str, Path], tmp_path: Path
) -> None:
    uri, _ = two_worker_run
    env = _env(s3, tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "rlreplay", "ls", uri, "--json"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    listings = [[json.loads(line) for line in out.splitlines()] for out, _ in outs]
    assert len(listings[0]) == 64 and listings[1] == listings[0] and listings[2] == listings[0]
    assert is_cached(tmp_path / "cache", ".parquet") == []
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_shards_without_index_files_are_listed_without_fetching_them(s3: S3Server, tmp_path: Path) -> None:
    """Format 1 shards have no index file: their metadata columns are read in place on the store."""
    fixture = tmp_path / "v1-run"  # as published: sealed files only (the live one stays in its spool)
    shutil.copytree(
        Path(__file__).parents[1] / "fixtures" / "v1-run", fixture, ignore=shutil.ignore_patterns("_part-*")
    )
    client = s3.client()
    for path in sorted(p for p in fixture.rglob("*") if p.is_file()):
        client.put_object(
            Bucket=BUCKET, Key=f"exp/v1/{path.relative_to(fixture).as_posix()}", Body=path.read_bytes()
        )
    env = _env(s3, tmp_path)
    uri = f"s3://{BUCKET}/exp/v1"
    remote = _json_lines(rlreplay(env, "ls", uri, "--json", cwd=tmp_path))
    assert remote == _json_lines(rlreplay(env, "ls", str(fixture), "--json", cwd=tmp_path)) and remote
    assert is_cached(tmp_path / "cache", ".parquet") == []
    show = rlreplay(env, "show", remote[-1]["id"], "--run", uri, "--json", "--no-text", cwd=tmp_path)
    expected = rlreplay(
        env, "show", remote[-1]["id"], "--run", str(fixture), "--json", "--no-text", cwd=tmp_path
    )
    assert show.returncode == 0, show.stderr
    assert json.loads(show.stdout) == json.loads(expected.stdout)
    assert len(is_cached(tmp_path / "cache", ".parquet")) == 1


def test_info_names_the_run_and_sql_spans_sees_every_step(
    s3: S3Server, two_worker_run: tuple[str, Path], tmp_path: Path
) -> None:
    uri, local, env, cache = _listed_copy(s3, two_worker_run, tmp_path)

    info = rlreplay(env, "info", uri, cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    lines = {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in info.stdout.splitlines()
    }
    assert lines["run"] == uri  # the run's URI, not the cache it is read through
    assert lines["cache"] == str(next(cache.glob("*/*")))
    listed = rlreplay(env, "ls", uri, "--step", "3", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[-1] == f"4 trajectories in {uri}"

    # one trajectory shown: one shard of step 7 in the cache, the other 31 still on the store only
    rows = ls_json(env, uri, "--step", "7", cwd=tmp_path)
    assert (
        rlreplay(env, "show", rows[0]["id"], "--run", uri, "--json", "--no-text", cwd=tmp_path).returncode
        == 0
    )
    assert len(is_cached(cache, ".parquet")) == 1
    query = (
        "SELECT step, count(*) AS spans, count(DISTINCT trajectory_id) AS trajectories "
        "FROM spans GROUP BY step ORDER BY step"
    )
    remote = _json_lines(rlreplay(env, "sql", query, "--run", uri, "--json", cwd=tmp_path))
    expected = _json_lines(rlreplay(env, "sql", query, "--run", str(local), "--json", cwd=tmp_path))
    assert remote == expected
    assert [r["step"] for r in remote] == list(range(16)) and {r["trajectories"] for r in remote} == {4}


def test_watch_follows_a_run_recorded_into_the_store(s3: S3Server, tmp_path: Path) -> None:
    """``rlreplay watch s3://...`` beside the job that records there: every step, the fault's alerts
    naming only faulty rollouts, while the job runs."""
    from watch_live import faulty_ids, watch_beside

    fault_step = 2
    watched = watch_beside(
        f"s3://{BUCKET}/watched/run", tmp_path / "control", 5, fault_step, env=_env(s3, tmp_path)
    )
    assert watched.record_code == 0
    assert watched.steps == list(range(5)), (watched.events, watched.watch_stderr)
    assert watched.running_then
    assert watched.watch_code == 1, watched.watch_stderr
    ids = faulty_ids(tmp_path / "control")
    assert not [a for a in watched.alerts if a["step"] < fault_step]
    assert {a["check"] for a in watched.alerts if a["step"] == fault_step} >= {"repetition", "tool_error"}
    for alert in watched.alerts:
        assert alert["trajectories"]
        assert all(ids[alert["step"]][i] for i in alert["trajectories"]), alert
