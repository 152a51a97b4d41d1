"""Publishing a recording to an object store: a local spool, a publisher thread, recovery of what was left."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlreplay import settings
from rlreplay.format import manifest
from rlreplay.remote.location import (
    Location,
    as_uri,
    error_line,
    exists,
    list_objects,
    local_path,
    location,
    read_bytes,
    redact,
    upload_file,
    write_json,
)
from rlreplay.shards.layout import LEASE_DIR, PARTIAL_SUFFIX, SEALED_SUFFIX, SPANS_DIR
from rlreplay.shards.lease import close_marker, host_name, is_live, lease_owner, lease_ttl_s, live_leases
from rlreplay.shards.recover import recover_run
from rlreplay.words import plural

log = logging.getLogger("rlreplay")

MAX_BACKOFF_S = 30.0
UPLOAD_THREADS = 8


# ---- spool and publisher ------------------------------------------------------------------------


def spool_root(spool: str | os.PathLike[str] | None = None) -> Path:
    """Where local spools live: ``spool``, else ``$RLREPLAY_SPOOL``, else ~/.cache/rlreplay/spool."""
    chosen = spool or settings.SPOOL.get()
    if chosen:
        return Path(chosen).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "rlreplay" / "spool"


def run_spool(loc: Location, spool: str | os.PathLike[str] | None = None) -> Path:
    """This node's spool folder for a run: one run directory per recording process inside it."""
    folder = spool_root(spool) / loc.key
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        (folder / "URI").write_text(redact(loc.uri) + "\n")
    return folder


@dataclass
class PublishStats:
    published: int = 0
    published_bytes: int = 0
    pending: int = 0
    upload_errors: int = 0
    last_error: str | None = None


@dataclass
class _Retry:
    attempts: int = 0
    next_at: float = 0.0


@dataclass
class Publisher:
    """Uploads what is sealed in one spool run directory; a thread while recording, then a drain."""

    loc: Location
    spool_dir: Path
    lease_name: str | None = None  # the remote lease object announcing this process while it records
    manifest_owner: bool = False  # upload run.json even over an existing one (the driver's final word)
    interval_s: float = 1.0
    stats: PublishStats = field(default_factory=PublishStats)
    _uploaded: dict[str, tuple[float, int]] = field(default_factory=dict)
    _retry: dict[str, _Retry] = field(default_factory=dict)
    _manifest_done: bool = False
    _last_beat: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rlreplay-publisher", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Publish now (a shard was just sealed), not at the next timed round."""
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            with contextlib.suppress(Exception):
                self.publish_once()

    def _candidates(self) -> list[tuple[str, Path, bool]]:
        """(relative name, local file, delete after upload) of everything to publish now."""
        out: list[tuple[str, Path, bool]] = []
        spans = self.spool_dir / SPANS_DIR
        if spans.is_dir():
            for path in sorted(spans.glob(f"step=*/worker=*/*{SEALED_SUFFIX}")):
                if not path.name.startswith(("_", ".")):
                    out.append((path.relative_to(self.spool_dir).as_posix(), path, True))
        workers = self.spool_dir / manifest.WORKERS_DIR
        if workers.is_dir():
            for path in sorted(workers.glob("*.json")):
                if not path.name.startswith(("_", ".")):
                    out.append((path.relative_to(self.spool_dir).as_posix(), path, False))
        return out

    def publish_once(self, force: bool = False) -> int:
        """Upload what is due; returns how many files still wait (pending)."""
        with self._lock:
            now = time.monotonic()
            pending = 0
            if not self._manifest_done:
                pending += not self._publish_manifest(now, force)
            due = []
            for rel, path, delete in self._candidates():
                try:
                    stat = path.stat()
                except FileNotFoundError:
                    continue
                if not delete and self._uploaded.get(rel) == (stat.st_mtime, stat.st_size):
                    continue
                retry = self._retry.get(rel)
                if retry is not None and now < retry.next_at and not force:
                    pending += 1
                    continue
                due.append((rel, path, delete, stat))
            for (rel, path, delete, stat), outcome in zip(due, self._upload_all(due)):
                if isinstance(outcome, BaseException):
                    self._failed(rel, now, outcome)
                    pending += 1
                    continue
                self._retry.pop(rel, None)
                if outcome is not None:  # None: published by another process sharing this spool
                    self.stats.published += 1
                    self.stats.published_bytes += outcome
                if delete:
                    for sidecar in _sidecars(path):
                        sidecar.unlink(missing_ok=True)
                    path.unlink(missing_ok=True)
                else:
                    self._uploaded[rel] = (stat.st_mtime, stat.st_size)
            if self.lease_name is not None and pending == 0 and now - self._last_beat > lease_ttl_s() / 4:
                self._beat(now)
            self.stats.pending = pending
            return pending

    def _upload_all(self, due: list[tuple[str, Path, bool, Any]]) -> list[int | BaseException | None]:
        """Upload files concurrently (the store's latency, not bandwidth, bounds one at a time)."""

        def one(item: tuple[str, Path, bool, Any]) -> int | BaseException | None:
            rel, path = item[0], item[1]
            try:
                size = 0
                for sidecar in _sidecars(path):  # a shard's index goes first: readers find both
                    size += upload_file(self.loc, sidecar, rel.rsplit("/", 1)[0] + "/" + sidecar.name)
                return size + upload_file(self.loc, path, rel)
            except FileNotFoundError:
                return None
            except Exception as exc:
                return exc

        if len(due) > 1:
            try:
                with ThreadPoolExecutor(max_workers=min(UPLOAD_THREADS, len(due))) as pool:
                    return list(pool.map(one, due))
            except RuntimeError:  # at interpreter exit no pool starts: one at a time
                pass
        return [one(item) for item in due]

    def _failed(self, rel: str, now: float, exc: BaseException) -> None:
        import random

        retry = self._retry.setdefault(rel, _Retry())
        retry.attempts += 1
        delay = min(MAX_BACKOFF_S, 0.5 * 2 ** (retry.attempts - 1))
        retry.next_at = now + delay * random.uniform(0.8, 1.2)
        self.stats.upload_errors += 1
        self.stats.last_error = error_line(exc)

    def _publish_manifest(self, now: float, force: bool) -> bool:
        """The spool's manifest, unless the run has one already (the first process wins)."""
        local = self.spool_dir / manifest.MANIFEST
        retry = self._retry.get(manifest.MANIFEST)
        if not local.exists():
            return True
        if retry is not None and now < retry.next_at and not force:
            return False
        try:
            if self.manifest_owner or not exists(self.loc, manifest.MANIFEST):
                upload_file(self.loc, local, manifest.MANIFEST)
        except Exception as exc:
            self._failed(manifest.MANIFEST, now, exc)
            return False
        self._retry.pop(manifest.MANIFEST, None)
        self._manifest_done = True
        return True

    def _beat(self, now: float) -> None:
        self._last_beat = now
        owner = {"host": host_name(), "pid": os.getpid(), "spool": str(self.spool_dir), "at": time.time()}
        with contextlib.suppress(Exception):
            write_json(self.loc, f"{LEASE_DIR}/{self.lease_name}", owner)

    def close(self, timeout_s: float = 30.0) -> PublishStats:
        """Stop the thread, then upload what is left, retrying until done or ``timeout_s``."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        pending = self.publish_once(force=True)
        while pending and time.monotonic() < deadline:
            due = min((r.next_at for r in self._retry.values()), default=time.monotonic())
            time.sleep(max(0.05, min(due - time.monotonic(), deadline - time.monotonic(), 2.0)))
            pending = self.publish_once(force=time.monotonic() >= due)
        if self.stats.upload_errors or self.stats.pending:  # counted in the run: `rlreplay info`
            status = {"upload_errors": self.stats.upload_errors, "pending_uploads": self.stats.pending}
            with contextlib.suppress(Exception):
                write_json(self.loc, f"{manifest.WORKERS_DIR}/upload-{self.spool_dir.name}.json", status)
        if self.lease_name is not None:
            with contextlib.suppress(Exception):
                self.loc.fs.delete_file(self.loc.path(f"{LEASE_DIR}/{self.lease_name}"))
        _add_totals(self.stats)
        return self.stats


_totals = PublishStats()


def _add_totals(stats: PublishStats) -> None:
    _totals.published += stats.published
    _totals.published_bytes += stats.published_bytes
    _totals.pending += stats.pending
    _totals.upload_errors += stats.upload_errors
    _totals.last_error = stats.last_error or _totals.last_error


def upload_stats() -> PublishStats:
    """What this process's publishers uploaded, failed (retried) and left pending, once drained."""
    return PublishStats(**_totals.__dict__)


def _sidecars(shard: Path) -> list[Path]:
    """Files sealed with a shard (its trajectory index): ``part-X.*`` beside ``part-X.parquet``."""
    if not shard.name.endswith(SEALED_SUFFIX):
        return []
    stem = shard.name.removesuffix(SEALED_SUFFIX)
    return [p for p in shard.parent.glob(f"{stem}.*") if p != shard and not p.name.endswith(".tmp")]


# ---- the recorder's hooks -----------------------------------------------------------------------


@dataclass
class _Attached:
    loc: Location
    publisher: Publisher | None
    pid: int


_attached: dict[Path, _Attached] = {}


def recording_dir(target: str | os.PathLike[str]) -> Path:
    """The local run directory a recording process writes into.

    A local path is returned as is. For a URI this process gets its own spool directory and a
    publisher thread uploading what is sealed there; :func:`recorder_closed` drains it.
    """
    uri = as_uri(target)
    if uri is None:
        return local_path(target)
    loc = location(uri)
    import pyarrow.fs  # noqa: F401 - now, so its exit hook runs after the recorder's close

    spool_dir = run_spool(loc) / f"{host_name()}-{os.getpid()}-{os.urandom(3).hex()}"
    spool_dir.mkdir(parents=True, exist_ok=True)
    interval = settings.PUBLISH_INTERVAL_S.get_or_default()
    publisher = Publisher(loc, spool_dir, lease_name=f"_lease-{spool_dir.name}.json", interval_s=interval)
    publisher.start()
    _attached[spool_dir] = _Attached(loc, publisher, os.getpid())
    return spool_dir


def shard_sealed(run_dir: Path) -> None:
    """A recorder sealed a shard in ``run_dir``: its publisher uploads it now (no-op for a local run)."""
    attached = _attached.get(Path(run_dir))
    if attached is not None and attached.publisher is not None and attached.pid == os.getpid():
        attached.publisher.wake()


def recorder_closed(run_dir: Path, timeout_s: float | None = None) -> PublishStats | None:
    """After a recorder sealed its files: upload what its spool holds (a no-op for a local run)."""
    attached = _attached.get(Path(run_dir))
    if attached is None:
        return None
    if timeout_s is None:
        timeout_s = settings.UPLOAD_TIMEOUT_S.get_or_default()
    owner = attached.pid == os.getpid()
    publisher = attached.publisher
    if publisher is None or not owner:  # a forked child: the thread stayed with the parent
        publisher = Publisher(attached.loc, Path(run_dir))
    else:
        del _attached[Path(run_dir)]
    stats = publisher.close(timeout_s)
    if stats.pending:
        shown = redact(attached.loc.uri)
        print(
            f"rlreplay: {stats.pending} files not uploaded to {shown} ({stats.last_error}); "
            f"they wait in {run_dir}: run `rlreplay recover {shown}`",
            file=sys.stderr,
        )
    elif owner:
        _remove_spool(Path(run_dir))
    return stats


def _remove_spool(spool_dir: Path) -> None:
    """Delete a fully published spool directory (nothing live, nothing sealed left in it)."""
    spans = spool_dir / SPANS_DIR
    if spans.is_dir() and any(spans.glob(f"step=*/worker=*/*{PARTIAL_SUFFIX}")):
        return
    if spans.is_dir() and any(spans.glob(f"step=*/worker=*/*{SEALED_SUFFIX}")):
        return
    shutil.rmtree(spool_dir, ignore_errors=True)


def remote_leases(loc: Location) -> list[str]:
    """Lease objects of processes still recording into the run (heartbeat fresher than the TTL)."""
    ttl = lease_ttl_s()
    now = time.time()
    fresh = []
    for info in list_objects(loc, LEASE_DIR):
        name = info.path.rsplit("/", 1)[-1]
        if name.startswith("_lease-") and info.mtime is not None and now - info.mtime.timestamp() < ttl:
            fresh.append(name)
    return fresh


def wait_for_writers(loc: Location, wait_s: float) -> list[str]:
    """Wait up to ``wait_s`` for recording processes on every node to finish uploading."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            live = remote_leases(loc)
        except Exception:
            return []
        if not live or time.monotonic() >= deadline:
            return live
        time.sleep(0.2)


def spool_dirs(loc: Location, spool: str | os.PathLike[str] | None = None) -> list[Path]:
    folder = spool_root(spool) / loc.key
    return sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def recover(
    uri: str, spool: str | os.PathLike[str] | None = None, wait_s: float = 0.0, timeout_s: float = 30.0
) -> dict[str, Any]:
    """Seal and upload what processes of this node left in their spools for run ``uri``.

    Spools of processes still recording are left alone. Returns the totals ``recover`` prints.
    """
    loc = location(uri)
    totals: dict[str, Any] = dict.fromkeys(
        ("recovered_shards", "recovered_spans", "discarded_bytes", "live_partials", "uploaded", "pending"), 0
    )
    totals["error"] = None
    deadline = time.monotonic() + wait_s
    for spool_dir in spool_dirs(loc, spool):
        if spool_dir in _attached and _attached[spool_dir].pid == os.getpid():
            continue  # this process is still recording into it
        while live_leases(spool_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        if live_leases(spool_dir):
            totals["live_partials"] += 1
            continue
        recovery = recover_run(spool_dir)
        recovered, live = recovery.sealed, recovery.live
        totals["recovered_shards"] += len(recovered)
        totals["recovered_spans"] += sum(r.rows for r in recovered)
        totals["discarded_bytes"] += sum(r.set_aside_bytes for r in recovery.files)
        totals["live_partials"] += len(live)
        publisher = Publisher(loc, spool_dir)
        stats = publisher.close(timeout_s)
        totals["uploaded"] += stats.published
        totals["pending"] += stats.pending
        totals["error"] = totals["error"] or stats.last_error
        if recovered and not stats.pending:
            _add_recovered(loc, len(recovered), sum(r.rows for r in recovered))
        if not stats.pending and not live:
            _remove_spool(spool_dir)
    for driver_manifest in sorted((spool_root(spool) / loc.key).glob("run-*.json")):
        try:  # the final manifest of a `record` that could not reach the store
            upload_file(loc, driver_manifest, manifest.MANIFEST)
        except (OSError, ValueError) as exc:
            totals["pending"] += 1
            totals["error"] = totals["error"] or error_line(exc)
            continue
        totals["uploaded"] += 1
        driver_manifest.unlink(missing_ok=True)
    return totals


def _add_recovered(loc: Location, shards: int, spans: int) -> None:
    with contextlib.suppress(Exception):
        data = json.loads(read_bytes(loc, manifest.MANIFEST))
        data["recovered_shards"] = int(data.get("recovered_shards", 0) or 0) + shards
        data["recovered_spans"] = int(data.get("recovered_spans", 0) or 0) + spans
        write_json(loc, manifest.MANIFEST, data)


def recover_message(uri: str, totals: dict[str, Any]) -> str:
    text = (
        f"recovered {plural(totals['recovered_shards'], 'shard')} "
        f"({plural(totals['recovered_spans'], 'span')}); "
        f"uploaded {plural(totals['uploaded'], 'file')} to {redact(uri)}"
    )
    if totals["live_partials"]:
        text += f"; left alone {plural(totals['live_partials'], 'file')} still being written"
    if totals["pending"]:
        text += f"; {plural(totals['pending'], 'file')} still waiting in the spool ({totals['error']})"
    return text


def close_node_writers(
    target: str | os.PathLike[str],
    spool: str | os.PathLike[str] | None = None,
    wait_s: float = 30.0,
    exclude_pid: int | None = None,
) -> int:
    """Ask the processes of this node recording into ``target`` to close (seal, upload), and wait.

    Run on each node when a job ends: a cluster kills the job's actors without letting them
    close. Returns how many processes were asked.
    """
    uri = as_uri(target)
    if uri is None:
        folders = [local_path(target)]
    else:
        folder = spool_root(spool) / location(uri).key
        folders = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    leases = []
    for folder in folders:
        for lease in Path(folder, LEASE_DIR).glob("_lease-*.lock"):
            owner = lease_owner(lease)
            mine = owner is not None and owner.get("host") == host_name()
            if mine and owner.get("pid") != exclude_pid and is_live(lease):
                with contextlib.suppress(OSError):
                    close_marker(lease).touch()
                    leases.append(lease)
    deadline = time.monotonic() + wait_s
    while any(p.exists() for p in leases) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(leases)
