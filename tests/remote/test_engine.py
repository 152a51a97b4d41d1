# ruff: noqa: F811  (the store fixture, imported from test_object_store, is the tests' argument)
"""Whole-run questions on a run on an object store: the run's kept tokenizer comes with it, and
``--engine ray`` on a real 3-node Ray cluster answers as ``--engine local`` does on a local copy.

The shipped showcase run is uploaded to a real S3 server (moto) on 127.0.0.1; the cluster is
started once for this module (Ray's start-up is slow on 2 cores) and every command runs as the
user runs it, in a process of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_object_store import BUCKET, S3Server, _env, _free_port, rlreplay, s3  # noqa: F401  (s3: a fixture)

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
