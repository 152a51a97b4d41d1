"""A run on a shared filesystem (NFS, Lustre) written by processes on several nodes.

Locks do not cross nodes there, so a lease names its owner (host, pid) and beats a heartbeat
(its mtime). Two hosts are simulated with ``$RLREPLAY_HOST``: a process of "node-b" records and
ends without closing (as seen from node-a, whose locks cannot see node-b's); recovery on node-a
must leave node-b's live file alone while node-b's heartbeat is fresh, and seal it once stale.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import rlreplay
from rlreplay.shards.layout import LEASE_DIR, list_files
from rlreplay.shards.lease import Lease, is_live, live_leases
from rlreplay.shards.recover import recover_run

OTHER_NODE = textwrap.dedent(
    """
    import os, sys
    import rlreplay
    rlreplay.init(sys.argv[1], worker="node-b-worker")
    with rlreplay.trajectory(step=3, sample_index=0, rollout_n=0):
        pass
    assert rlreplay.flush()
    os._exit(0)  # no close: the partial and the lease stay, and no lock of this node is visible
    """
)


def _record_on(host: str, run_dir: Path) -> None:
    env = {**os.environ, "RLREPLAY_HOST": host}
    env.pop("RLREPLAY_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-c", OTHER_NODE, str(run_dir)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def node_a(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLREPLAY_HOST", "node-a")


def test_live_file_of_another_node_is_never_sealed(tmp_path: Path, node_a: None) -> None:
    run_dir = tmp_path / "run"
    _record_on("node-b", run_dir)
    (partial,) = list_files(run_dir)[1]
    (lease,) = (run_dir / LEASE_DIR).glob("_lease-*.lock")
    owner = json.loads(lease.read_text())
    assert owner["host"] == "node-b" and owner["pid"] > 0

    assert is_live(partial) and is_live(lease)
    assert live_leases(run_dir) == [lease]  # not removed as stale
    recovery = recover_run(run_dir)
    results, live = recovery.sealed, recovery.live
    assert results == [] and live == [partial]
    assert partial.exists() and lease.exists()

    old = time.time() - 3600  # node-b's heartbeat stopped long ago: it is dead
    os.utime(lease, (old, old))
    assert not is_live(partial) and live_leases(run_dir) == []
    assert not lease.exists()
    recovery = recover_run(run_dir)
    results, live = recovery.sealed, recovery.live
    assert live == [] and [r.rows for r in results] == [1]
    assert len(rlreplay.open_run(run_dir).trajectories()) == 1


def test_dead_process_of_this_node_is_recovered_at_once(tmp_path: Path, node_a: None) -> None:
    run_dir = tmp_path / "run"
    _record_on("node-a", run_dir)
    (lease,) = (run_dir / LEASE_DIR).glob("_lease-*.lock")
    assert json.loads(lease.read_text())["host"] == "node-a"
    assert live_leases(run_dir) == []  # same host: the lock is authoritative, however fresh the file
    recovery = recover_run(run_dir)
    results, live = recovery.sealed, recovery.live
    assert live == [] and [r.rows for r in results] == [1]


def test_lease_heartbeat_keeps_it_fresh(
    tmp_path: Path, node_a: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLREPLAY_LEASE_TTL_S", "0.4")
    lease = Lease(tmp_path)
    try:
        old = time.time() - 3600
        os.utime(lease.path, (old, old))
        deadline = time.monotonic() + 5
        while time.time() - lease.path.stat().st_mtime > 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.time() - lease.path.stat().st_mtime <= 0.4
        monkeypatch.setenv("RLREPLAY_HOST", "node-c")  # as another node sees it: fresh, so live
        assert is_live(lease.path)
    finally:
        lease.release()
    assert not lease.path.exists()
