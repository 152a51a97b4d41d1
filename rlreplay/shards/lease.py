"""Leases: which process still writes a run's live files, and asking it to close."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlreplay import settings
from rlreplay.shards.layout import LEASE_DIR, new_uid

_PARTIAL_PID = re.compile(r"^_part-[0-9a-f]+-(\d+)-")
#: Files holding a lock (leases, live files): each is disowned in a forked child (``disown``).
open_writers: weakref.WeakSet[Any] = weakref.WeakSet()


def host_name() -> str:
    """This node's name as leases record it (``$RLREPLAY_HOST`` overrides the hostname)."""
    return settings.HOST.get() or socket.gethostname()


def lease_ttl_s() -> float:
    """How long a lease of another node counts as live after its last heartbeat."""
    return settings.LEASE_TTL_S.get_or_default()


class Lease:
    """A lock a recording process holds for its whole life, so recovery can wait for it to end.

    The file names its owner (host and pid) and its mtime is a heartbeat, refreshed by a thread:
    on a shared filesystem, where locks may not cross nodes, another node tells a live lease from
    a dead one by the heartbeat's age.
    """

    def __init__(self, run_dir: Path, on_close_request: Callable[[], Any] | None = None) -> None:
        folder = Path(run_dir) / LEASE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"_lease-{new_uid()}.lock"
        self._file = open(self.path, "xb")  # noqa: SIM115 - closed in release()
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        open_writers.add(self)
        owner = {"host": host_name(), "pid": os.getpid(), "started_at": time.time()}
        self._file.write(json.dumps(owner).encode())
        self._file.flush()
        self._on_close_request = on_close_request
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="rlreplay-lease", daemon=True)
        with contextlib.suppress(RuntimeError):  # at interpreter shutdown: no heartbeat, the lock holds
            self._heartbeat.start()

    def _beat(self) -> None:
        every = max(0.05, lease_ttl_s() / 4)
        marker = close_marker(self.path)
        last = time.monotonic()
        while not self._stop.wait(min(every, 0.5)):
            if self._on_close_request is not None and marker.exists():
                with contextlib.suppress(Exception):
                    self._on_close_request()
                return
            if time.monotonic() - last >= every:
                last = time.monotonic()
                with contextlib.suppress(OSError):
                    os.utime(self.path)

    def disown(self, devnull: int) -> None:
        """In a forked child: point this (the parent's) lease at ``devnull``; the parent keeps it."""
        if not self._file.closed:
            os.dup2(devnull, self._file.fileno())

    def release(self) -> None:
        self._stop.set()
        if not self._file.closed:
            self.path.unlink(missing_ok=True)
            close_marker(self.path).unlink(missing_ok=True)
            self._file.close()


def close_marker(lease: Path) -> Path:
    """A file asking the lease's process to close its recorder (its job is ending)."""
    return lease.with_name(lease.name + ".close")


def lease_owner(path: Path) -> dict[str, Any] | None:
    """The host and pid written in a lease, or None when it names none."""
    try:
        owner = json.loads(Path(path).read_bytes() or b"null")
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and "host" in owner else None


def _fresh(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime < lease_ttl_s()
    except FileNotFoundError:
        return False


def _foreign(owner: dict[str, Any] | None) -> bool:
    return owner is not None and owner.get("host") != host_name()


def live_leases(run_dir: Path) -> list[Path]:
    """Leases still held by running recorders; stale ones (their process died) are removed."""
    live = []
    for path in Path(run_dir, LEASE_DIR).glob("_lease-*.lock"):
        if is_live(path):
            live.append(path)
        else:
            path.unlink(missing_ok=True)
    return live


def _release_inherited_writers() -> None:
    """In a forked child: drop the parent's open partials (and their locks) without writing to them."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for writer in list(open_writers):
        writer.disown(devnull)
    os.close(devnull)
    open_writers.clear()


def _locked(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            return False
    except FileNotFoundError:
        return False


def is_live(partial: Path) -> bool:
    """Whether a process still holds this partial (or lease) open, on this node or another one.

    A lease of another host is live while its heartbeat is fresh; a partial is live while it is
    locked, or while a live lease of another host names its writer's pid.
    """
    partial = Path(partial)
    if partial.name.startswith("_lease-"):
        owner = lease_owner(partial)
        return _fresh(partial) if _foreign(owner) else _locked(partial)
    if _locked(partial):
        return True
    if not partial.exists():
        return False
    match = _PARTIAL_PID.match(partial.name)
    pid = int(match.group(1)) if match else None
    leases = partial.parent.parent.parent.parent / LEASE_DIR  # run/spans/step=S/worker=W/_part-...
    for lease in leases.glob("_lease-*.lock"):
        owner = lease_owner(lease)
        if _foreign(owner) and (pid is None or owner.get("pid") == pid) and _fresh(lease):
            return True
    return False


os.register_at_fork(after_in_child=_release_inherited_writers)
