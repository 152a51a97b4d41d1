"""Runs that live on an object store (``s3://``, ``gs://``, any pyarrow.fs or fsspec filesystem).

Recording: each process records into a local spool directory (a normal run directory) and a
publisher thread uploads what is sealed there: shards, worker counters, the manifest. A shard
is uploaded whole, then deleted from the spool; while the store is unreachable files wait in
the spool (counted as pending) and are retried with backoff. ``rlreplay recover URI`` pushes
what a killed process left in this node's spool.

Reading: a local cache directory per run URI receives only the objects a read needs: a listing
fetches the index files of the shards it lists (``ls --step K``: of ``spans/step=K/`` only) and
keeps a run index there; a span read fetches the shards holding its rows. The local reader runs
on it, with the shards' sizes and times taken from the store's listing.

Credentials come from each store's standard environment and config (for S3: ``AWS_*``
variables and profiles, ``AWS_ENDPOINT_URL[_S3]`` for another endpoint); they are never written
into a run, and errors are redacted before they are shown.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlreplay import manifest
from rlreplay.shards import (
    LEASE_DIR,
    PARTIAL_SUFFIX,
    SEALED_SUFFIX,
    SPANS_DIR,
    host_name,
    lease_ttl_s,
    live_leases,
    recover_run,
)

log = logging.getLogger("rlreplay")

ENV_SPOOL = "RLREPLAY_SPOOL"
ENV_CACHE = "RLREPLAY_CACHE"
ENV_PUBLISH_INTERVAL = "RLREPLAY_PUBLISH_INTERVAL_S"
ENV_UPLOAD_TIMEOUT = "RLREPLAY_UPLOAD_TIMEOUT_S"  # how long a closing process retries its last uploads
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/+(.*)$")  # also "s3:/b/p": a URI after Path() folded "//"
_USERINFO = re.compile(r"(://)[^/@\s]+@")
_QUERY_SECRET = re.compile(r"(?i)([?&][^=&\s]*(?:key|secret|token|password|credential)[^=&\s]*=)[^&\s]+")
_LOCAL_SCHEMES = ("file", "local")
MAX_BACKOFF_S = 30.0
UPLOAD_THREADS = 8


class StorageError(Exception):
    """A run location that cannot be used: unreachable store, missing bucket, bad credentials."""


def as_uri(value: str | os.PathLike[str] | None) -> str | None:
    """The URI ``value`` names (``scheme://...``), or None for a local path (``file://`` is local)."""
    if value is None:
        return None
    match = _URI.match(os.fspath(value))
    if match is None or match.group(1).lower() in _LOCAL_SCHEMES:
        return None
    return f"{match.group(1).lower()}://{match.group(2)}"


def local_path(value: str | os.PathLike[str]) -> Path:
    """A local run path (``file://`` stripped)."""
    text = os.fspath(value)
    match = _URI.match(text)
    if match is not None and match.group(1).lower() in _LOCAL_SCHEMES:
        return Path("/" + match.group(2))
    return Path(text)


def redact(text: str) -> str:
    """Hide credentials a message may carry: URI user info, secret query values, env key values."""
    text = _QUERY_SECRET.sub(r"\1" + manifest.REDACTED, _USERINFO.sub(r"\1" + manifest.REDACTED + "@", text))
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        secret = os.environ.get(name)
        if secret and len(secret) >= 4:
            text = text.replace(secret, manifest.REDACTED)
    return manifest.redact_value(text)


def error_line(exc: BaseException) -> str:
    return redact(" ".join(str(exc).split())[:300] or type(exc).__name__)


@dataclass
class Location:
    """A run on a filesystem reached through pyarrow.fs: ``fs`` and the run's ``root`` path in it."""

    uri: str
    fs: Any
    root: str

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    @property
    def name(self) -> str:
        return self.root.rstrip("/").rsplit("/", 1)[-1] or "run"

    @property
    def key(self) -> str:
        """A short stable name for this run's spool and cache folders (no credentials in it)."""
        bare = _USERINFO.sub(r"\1", self.uri.split("?", 1)[0]).rstrip("/")
        return hashlib.sha1(bare.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"Location({redact(self.uri)!r})"


_locations: dict[str, Location] = {}
_locations_lock = threading.Lock()


def location(uri: str) -> Location:
    """The filesystem and root of a run URI (cached per process)."""
    with _locations_lock:
        loc = _locations.get(uri)
        if loc is None:
            loc = _locations[uri] = _make_location(uri)
        return loc


def _make_location(uri: str) -> Location:
    import pyarrow.fs as pafs

    scheme, _, rest = uri.partition("://")
    rest = rest.split("?", 1)[0].rstrip("/")
    if not rest or not rest.split("/", 1)[0]:
        raise StorageError(f"{redact(uri)}: no bucket or path in the URI")
    if scheme in ("s3", "s3a"):
        return Location(uri, _s3_filesystem(pafs), rest)
    if scheme in ("gs", "gcs"):
        return Location(uri, pafs.GcsFileSystem(retry_time_limit_seconds=10), rest)
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
        return Location(uri, fs, root.rstrip("/"))
    except (ValueError, OSError):
        pass  # not a pyarrow filesystem: try fsspec's
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        fs, root = fsspec.core.url_to_fs(uri)
        return Location(uri, PyFileSystem(FSSpecHandler(fs)), str(root).rstrip("/"))
    except ImportError as exc:
        raise StorageError(
            f"{redact(uri)}: no filesystem for {scheme}:// (install fsspec and its {scheme} package)"
        ) from exc
    except Exception as exc:
        raise StorageError(f"{redact(uri)}: {error_line(exc)}") from exc


def _s3_filesystem(pafs: Any) -> Any:
    """pyarrow's S3 with the standard environment; ``AWS_ENDPOINT_URL[_S3]`` picks another endpoint."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs: dict[str, Any] = {
        "connect_timeout": 2.0,
        "request_timeout": 10.0,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=2),
    }
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    if endpoint:
        scheme, sep, host = endpoint.partition("://")
        kwargs["endpoint_override"] = host.rstrip("/") if sep else endpoint
        if sep:
            kwargs["scheme"] = scheme
        kwargs.setdefault("region", "us-east-1")
    return pafs.S3FileSystem(**kwargs)


def _is_object_store(fs: Any) -> bool:
    return fs.type_name in ("s3", "gcs", "abfs")


def upload_file(loc: Location, local: Path, rel: str) -> int:
    """Copy one local file to ``rel`` under the run, visible only once whole; returns its size."""
    data = local.read_bytes()
    target = loc.path(rel)
    fs = loc.fs
    if _is_object_store(fs):  # an object appears only when its upload completes
        with fs.open_output_stream(target) as out:
            out.write(data)
        return len(data)
    parent = target.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/_{target.rsplit('/', 1)[1]}.{os.getpid()}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(data)
    fs.move(tmp, target)
    return len(data)


def read_bytes(loc: Location, rel: str) -> bytes:
    with loc.fs.open_input_stream(loc.path(rel)) as f:
        return f.read()


def exists(loc: Location, rel: str) -> bool:
    import pyarrow.fs as pafs

    return loc.fs.get_file_info(loc.path(rel)).type != pafs.FileType.NotFound


def _bucket_exists(loc: Location, bucket: str) -> bool:
    import pyarrow.fs as pafs

    return loc.fs.get_file_info(bucket).type != pafs.FileType.NotFound


def list_objects(loc: Location, rel: str) -> list[Any]:
    """Every file under ``rel`` (recursive), as pyarrow FileInfo; [] when there is none."""
    import pyarrow.fs as pafs

    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path(rel), recursive=True, allow_not_found=True))
    return [i for i in infos if i.type == pafs.FileType.File]


def list_dirs(loc: Location, rel: str) -> list[str]:
    """Names of the folders right under ``rel`` (one listing, not recursive); [] when there is none."""
    import pyarrow.fs as pafs

    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path(rel), recursive=False, allow_not_found=True))
    return [i.base_name for i in infos if i.type == pafs.FileType.Directory]


# ---- spool and publisher ------------------------------------------------------------------------


def spool_root(spool: str | os.PathLike[str] | None = None) -> Path:
    """Where local spools live: ``spool``, else ``$RLREPLAY_SPOOL``, else ~/.cache/rlreplay/spool."""
    chosen = spool or os.environ.get(ENV_SPOOL)
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
    interval = float(os.environ.get(ENV_PUBLISH_INTERVAL, 1.0))
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
        timeout_s = float(os.environ.get(ENV_UPLOAD_TIMEOUT, 30.0))
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


def write_json(loc: Location, rel: str, data: dict[str, Any]) -> None:
    payload = json.dumps(data, indent=2, sort_keys=True, default=str).encode()
    with loc.fs.open_output_stream(loc.path(rel)) as out:
        out.write(payload)


# ---- reading ------------------------------------------------------------------------------------


def cache_root() -> Path:
    chosen = os.environ.get(ENV_CACHE)
    if chosen:
        return Path(chosen).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "rlreplay" / "remote"


class Cache:
    """A local mirror of a remote run that fetches only the prefixes asked for."""

    def __init__(self, loc: Location, directory: Path | None = None) -> None:
        self.loc = loc
        self.dir = directory or cache_root() / loc.key / loc.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self._synced: set[str] = set()

    def fetch(self, rel: str, *, skip_private: bool = True) -> int:
        """Mirror every object under ``rel`` that the cache lacks; returns how many were fetched."""
        infos = list_objects(self.loc, rel)
        todo = []
        for info in infos:
            name = info.path[len(self.loc.root) + 1 :]
            if skip_private and any(part.startswith(("_", ".")) for part in name.split("/")[-1:]):
                continue
            local = self.dir / name
            if local.exists() and local.stat().st_size == info.size:
                continue
            todo.append((info.path, local))
        if todo:
            with ThreadPoolExecutor(max_workers=min(16, len(todo))) as pool:
                list(pool.map(lambda job: self._download(*job), todo))
        return len(todo)

    def _download(self, remote: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with self.loc.fs.open_input_stream(remote) as src, open(tmp, "wb") as out:
            while chunk := src.read(8 << 20):
                out.write(chunk)
        os.replace(tmp, local)

    def fetch_manifest(self) -> bool:
        """Refresh ``run.json``; False when the run has none."""
        try:
            data = read_bytes(self.loc, manifest.MANIFEST)
        except FileNotFoundError:
            return False
        tmp = self.dir / f".{manifest.MANIFEST}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.dir / manifest.MANIFEST)
        return True


def open_remote(uri: str) -> Any:
    """A :class:`rlreplay.store.Run` over a run URI, reading through a local cache."""
    from rlreplay.store import RunError

    try:
        loc = location(uri)
        cache = Cache(loc)
        has_manifest = cache.fetch_manifest()
        if not has_manifest and not list_objects(loc, SPANS_DIR):
            bucket = loc.root.split("/", 1)[0]
            if _is_object_store(loc.fs) and not exists(loc, "") and not _bucket_exists(loc, bucket):
                raise RunError(f"no bucket {bucket!r} at {redact(uri)} (or no access to it)")
            raise RunError(f"no run at {redact(uri)} (no {manifest.MANIFEST} and no {SPANS_DIR}/)")
        return _remote_run_class()(loc, cache)
    except StorageError as exc:
        raise RunError(str(exc)) from exc
    except OSError as exc:
        raise RunError(f"{redact(uri)}: {error_line(exc)}") from exc


_RemoteRun: type | None = None


def _cached(path: Path, size: int) -> bool:
    """Whether the cache holds this file as the store has it (objects are written once, whole)."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _remote_run_class() -> type:
    global _RemoteRun
    if _RemoteRun is not None:
        return _RemoteRun
    import pyarrow as pa
    import pyarrow.compute as pc

    from rlreplay.index import INDEX_SUFFIX, index_path
    from rlreplay.schema import PAYLOAD_COLUMNS
    from rlreplay.store import Filters, Run, RunError, _concat

    class RemoteRun(Run):
        """A run on an object store, read through a local cache. Listings fetch each shard's index
        file only (and keep a run index in the cache); span reads fetch the shards they read."""

        def __init__(self, loc: Location, cache: Cache) -> None:
            self.uri = loc.uri
            self.location = loc
            self.cache = cache
            # each listed shard's cache path -> (bytes, mtime in ns) of its object on the store
            self._objects: dict[Path, tuple[int, int]] = {}
            super().__init__(cache.dir)

        def __repr__(self) -> str:
            return f"Run({redact(self.uri)!r})"

        def _error(self, exc: BaseException) -> RunError:
            return RunError(f"{redact(self.uri)}: {error_line(exc)}")

        def _rel(self, path: Path) -> str:
            return path.relative_to(self.path).as_posix()

        def _download(self, files: list[Path]) -> None:
            """Fetch these cache files from their objects (concurrently: the store's latency bounds one)."""
            jobs = [(self.location.path(self._rel(p)), p) for p in files]
            try:
                if len(jobs) > 1:
                    with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
                        list(pool.map(lambda job: self.cache._download(*job), jobs))
                elif jobs:
                    self.cache._download(*jobs[0])
            except OSError as exc:
                raise self._error(exc) from exc

        def _paths(self, filters: Any) -> Any:
            """(sealed shards, no live files) the filters may need, listed on the store; their index
            files are brought into the cache (the shards are not)."""
            return self._list(filters, index_files=True), []

        def _list(self, filters: Any, index_files: bool) -> list[Path]:
            """The sealed shards the filters may need, listed on the store (with ``index_files``,
            their index files missing from the cache are fetched, concurrently)."""
            steps = filters.step if isinstance(filters.step, (list, tuple, set, frozenset)) else None
            if steps is not None and all(type(s) is int for s in steps):
                prefixes = [f"{SPANS_DIR}/step={s}" for s in sorted(set(steps))]
            else:
                single = filters.single_step() if steps is None else None
                prefixes = [SPANS_DIR if single is None else f"{SPANS_DIR}/step={single}"]
            shards: dict[Path, tuple[int, int]] = {}
            sidecars: dict[str, int] = {}
            try:
                for prefix in prefixes:
                    for info in list_objects(self.location, prefix):
                        rel = info.path[len(self.location.root) + 1 :]
                        parts = rel.split("/")
                        if len(parts) != 4 or parts[3].startswith(("_", ".")):
                            continue  # only spans/step=S/worker=W/NAME, no temp or private objects
                        if parts[3].endswith(SEALED_SUFFIX):
                            shards[self.path / rel] = (info.size, info.mtime_ns or 0)
                        elif parts[3].endswith(INDEX_SUFFIX):
                            sidecars[rel] = info.size
            except OSError as exc:
                raise self._error(exc) from exc
            self._objects.update(shards)
            missing = []
            for shard in shards if index_files else ():
                index = index_path(shard)
                size = sidecars.get(self._rel(index))
                if size is not None and not _cached(index, size):
                    missing.append(index)
            self._download(missing)
            return sorted(shards)

        def _stamp(self, path: Path) -> tuple[int, int]:
            found = self._objects.get(path)
            return found if found is not None else super()._stamp(path)

        def _sealed_source(self, path: Path, whole: bool) -> Any:
            found = self._objects.get(path)
            if found is None or _cached(path, found[0]):
                return path
            if not whole:  # some columns only (an index rebuilt): read in place, nothing cached
                try:
                    return self.location.fs.open_input_file(self.location.path(self._rel(path)))
                except OSError as exc:
                    raise self._error(exc) from exc
            self._download([path])
            return path

        def _holds(self, path: Path, filters: Any) -> bool:
            """Whether a shard may hold rows of the filters' trajectories (its index says)."""
            if filters.trajectory_id is None:
                return True
            index = self._index(path, True)
            if index is None:
                return True
            ids = dict(filters.items())["trajectory_id"]
            return bool(pc.any(pc.is_in(index["id"], value_set=pa.array(ids, pa.string()))).as_py())

        def _read_sealed(self, path: Path, filters: Any, columns: Any, row_groups: Any = None) -> Any:
            if row_groups is None and not self._holds(path, filters):
                return None
            return super()._read_sealed(path, filters, columns, row_groups)

        def _fetch_shards(self, filters: Any) -> list[Path]:
            """The shards the filters may need, those holding their rows brought into the cache."""
            sealed = self._list(filters, index_files=filters.trajectory_id is not None)
            self._download(
                [p for p in sealed if not _cached(p, self._objects[p][0]) and self._holds(p, filters)]
            )
            return sealed

        def fetch(self, step: int | None = None) -> None:
            """Bring the shards of one step (or of every step) into the cache."""
            self._fetch_shards(Filters(step=step))

        def load(self, traj_ids: Any, filters: Any = None) -> Any:
            wanted = list(traj_ids)
            if wanted:  # the shards holding them (their index files say which), all at once
                self._fetch_shards(Filters(**{**(filters or Filters()).__dict__, "trajectory_id": wanted}))
            return super().load(wanted, filters)

        def spans(self, filters: Any = None, columns: Any = None, **kw: Any) -> Any:
            """Span rows, as ``Run.spans``: the shards holding payload columns are fetched (all at
            once), metadata columns alone are read in place; shards are read concurrently."""
            filters = filters or Filters(**kw)
            cols = list(columns) if columns is not None else None
            if cols is None or any(c in PAYLOAD_COLUMNS for c in cols):
                sealed = self._fetch_shards(filters)
            else:
                sealed = self._list(filters, index_files=filters.trajectory_id is not None)
            with ThreadPoolExecutor(max_workers=min(16, max(1, len(sealed)))) as pool:
                tables = list(pool.map(lambda path: self._read_sealed(path, filters, cols), sealed))
            return _concat([t for t in tables if t is not None], cols)

        def step_partitions(self) -> list[str]:
            """The step folders on the store (listed, nothing fetched)."""
            try:
                names = list_dirs(self.location, SPANS_DIR)
            except OSError as exc:
                raise self._error(exc) from exc
            return [n.removeprefix("step=") for n in names if n.startswith("step=")]

        def file_signature(self) -> tuple[Any, ...]:
            """(object, bytes, mtime in ns) of every span and counter object on the store: changes
            whenever something is published (listed, nothing fetched)."""
            try:
                infos = list_objects(self.location, SPANS_DIR) + list_objects(
                    self.location, manifest.WORKERS_DIR
                )
            except OSError as exc:
                raise self._error(exc) from exc
            return tuple(sorted((i.path, i.size, i.mtime_ns or 0) for i in infos))

        def stored_bytes(self) -> int:
            """Bytes of the span files on the store (listed, nothing fetched)."""
            try:
                return sum(info.size for info in list_objects(self.location, SPANS_DIR))
            except OSError as exc:
                raise self._error(exc) from exc

        def counters(self) -> dict[str, int]:
            try:
                self.cache.fetch(manifest.WORKERS_DIR)
            except OSError as exc:
                raise self._error(exc) from exc
            totals = super().counters()
            for entry in manifest.read_worker_counters(self.path):
                for key in ("upload_errors", "pending_uploads"):
                    totals[key] = totals.get(key, 0) + int(entry.get(key, 0) or 0)
            return totals

    _RemoteRun = RemoteRun
    return RemoteRun


def recover_message(uri: str, totals: dict[str, Any]) -> str:
    text = (
        f"recovered {totals['recovered_shards']} shards ({totals['recovered_spans']} spans); "
        f"uploaded {totals['uploaded']} files to {redact(uri)}"
    )
    if totals["live_partials"]:
        text += f"; {totals['live_partials']} files still being written were left alone"
    if totals["pending"]:
        text += f"; {totals['pending']} files still wait in the spool ({totals['error']})"
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
    from rlreplay.shards import close_marker, is_live, lease_owner

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
