"""Span files on disk: live append-only streams, their compaction, and recovery after a crash.

Layout under a run directory::

    spans/step=5/worker=w0/_part-<uid>.partial   live Arrow IPC stream, ignored by scans
    spans/step=5/worker=w0/part-<uid>.parquet    sealed: sorted, Parquet zstd, queryable
    spans/step=5/worker=w0/part-<uid>.index      its trajectory index (``rlreplay.index``)

Sealed files are cut into row groups at trajectory boundaries (about ``ROW_GROUP_BYTES`` of
payload each), so one trajectory is read without the rest of its step.

A sealed file is written under a temporary name, fsynced and renamed; names are never reused,
and the partial is deleted only once its sealed file is durable.
"""

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
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rlreplay import arrow_ops as ops
from rlreplay import index as tindex
from rlreplay.manifest import QUARANTINE_DIR, UnsafePathError, quarantine, safe_run_path
from rlreplay.schema import (
    KEY_STR,
    META_COLUMNS,
    NULL_PARTITION,
    SPAN_SCHEMA,
    TOKEN_COLUMNS,
    FormatError,
    file_version,
    upgrade,
)

SPANS_DIR = "spans"
PARTIAL_SUFFIX = ".partial"
SEALED_SUFFIX = ".parquet"
#: Live files are not compressed (read once, when sealed to Parquet zstd): a codec costs per IPC
#: buffer (~60 per batch) whatever its size, lz4 ~1 ms per small batch against ~40 us uncompressed,
#: for ~1% fewer bytes (ids and log-probs barely compress). Each batch carries the CRC-32 of its
#: body instead (Arrow's lz4 frames have none), so a damaged batch is set aside, never misread.
BODY_CRC = "rlreplay.body_crc32"


def live_options() -> pa.ipc.IpcWriteOptions:
    """IPC options of live files."""
    return pa.ipc.IpcWriteOptions(compression=None)


def body_crc(batch: pa.RecordBatch) -> dict[str, str]:
    """The custom metadata a live batch is written with: the CRC-32 of its uncompressed IPC body."""
    return {BODY_CRC: str(zlib.crc32(pa.ipc.read_message(batch.serialize()).body))}


SEALED_ZSTD_LEVEL = 3
SORT_KEYS = [
    ("sample_index", "ascending"),
    (KEY_STR["sample_index"], "ascending"),
    ("rollout_n", "ascending"),
    (KEY_STR["rollout_n"], "ascending"),
    ("trajectory_id", "ascending"),
    ("start_ns", "ascending"),
]
ROW_GROUP_BYTES = 512 << 10
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_DICTIONARY_COLUMNS = ["trajectory_id", "name", "kind", "status", "experiment", "worker"]


def safe_name(name: str) -> str:
    """A worker name usable as a folder name and equal to what is stored in the files."""
    return _UNSAFE.sub("_", name).strip("._") or "worker"


def partition_dir(run_dir: Path, step: int | None, worker: str) -> Path:
    """A step's folder; a step that is not an integer shares the null partition."""
    is_int = isinstance(step, int) and not isinstance(step, bool)
    step_part = str(step) if is_int else NULL_PARTITION
    return Path(run_dir) / SPANS_DIR / f"step={step_part}" / f"worker={worker}"


def new_uid() -> str:
    return f"{time.time_ns():x}-{os.getpid()}-{os.urandom(3).hex()}"


def sealed_path_for(partial: Path) -> Path:
    return partial.with_name(partial.name[1:].removesuffix(PARTIAL_SUFFIX) + SEALED_SUFFIX)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_open_writers: weakref.WeakSet[Any] = weakref.WeakSet()  # files holding a lock: released in forked children
LEASE_DIR = "_workers"


class PartialWriter:
    """An append-only Arrow IPC stream; every ``write`` that returns is readable after a crash.

    The file is ``flock``ed while open, so recovery can tell a live writer from a dead one.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"_part-{new_uid()}{PARTIAL_SUFFIX}"
        self._file = open(self.path, "xb")  # noqa: SIM115 - closed in close(); holds the lock
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        _open_writers.add(self)
        # Arrow writes through its own file (no Python call per buffer), buffered, flushed per batch
        self._raw = pa.OSFile(str(self.path), "wb")
        self._sink = pa.BufferedOutputStream(self._raw, 1 << 18)
        self._writer = pa.ipc.new_stream(self._sink, SPAN_SCHEMA, options=live_options())
        self.rows = 0
        self.nbytes = 0  # Arrow bytes written (what sealing the file will hold in memory)
        self.opened_at = time.monotonic()
        self._dirty = False

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch, custom_metadata=body_crc(batch))
        self._sink.flush()
        self.rows += batch.num_rows
        self.nbytes += batch.get_total_buffer_size()  # batch.nbytes costs ~0.1 ms a batch
        self._dirty = True

    def fsync(self) -> None:
        if self._dirty:
            os.fsync(self._file.fileno())
            self._dirty = False

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self._writer.close()
            self._sink.close()
            os.fsync(self._file.fileno())
        finally:
            if not self._raw.closed:
                self._raw.close()
            self._file.close()


ENV_HOST = "RLREPLAY_HOST"
ENV_LEASE_TTL = "RLREPLAY_LEASE_TTL_S"
DEFAULT_LEASE_TTL_S = 60.0
_PARTIAL_PID = re.compile(r"^_part-[0-9a-f]+-(\d+)-")


def host_name() -> str:
    """This node's name as leases record it (``$RLREPLAY_HOST`` overrides the hostname)."""
    return os.environ.get(ENV_HOST) or socket.gethostname()


def lease_ttl_s() -> float:
    """How long a lease of another node counts as live after its last heartbeat."""
    try:
        return float(os.environ.get(ENV_LEASE_TTL, DEFAULT_LEASE_TTL_S))
    except ValueError:
        return DEFAULT_LEASE_TTL_S


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
        _open_writers.add(self)
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
    for writer in list(_open_writers):
        if not writer._file.closed:
            os.dup2(devnull, writer._file.fileno())
            raw = getattr(writer, "_raw", None)
            if raw is not None and not raw.closed:
                os.dup2(devnull, raw.fileno())
    os.close(devnull)
    _open_writers.clear()


os.register_at_fork(after_in_child=_release_inherited_writers)


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


@dataclass
class PartialContents:
    table: pa.Table
    batches: int
    discarded_bytes: int
    clean: bool


def read_partial(path: Path) -> PartialContents:
    """Every whole batch of a stream file, stopping cleanly at a torn tail."""
    size = path.stat().st_size
    batches: list[pa.RecordBatch] = []
    good_end = 0
    clean = False
    with open(path, "rb") as f:
        try:
            reader = pa.ipc.open_stream(f)
        except (pa.ArrowInvalid, OSError) as exc:
            raise FormatError(f"{path}: unreadable stream header ({exc})") from exc
        version = file_version(reader.schema, str(path))
        good_end = f.tell()
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                clean = True
                good_end = size
                break
            except (pa.ArrowInvalid, OSError, EOFError):
                break
            batches.append(batch)
            good_end = f.tell()
    table = pa.Table.from_batches(batches, schema=reader.schema)
    if version == 1:
        table = upgrade(table)
    return PartialContents(table, len(batches), 0 if clean else max(0, size - good_end), clean)


@dataclass
class SealResult:
    sealed: Path | None
    rows: int
    discarded_bytes: int
    recovered: bool


def seal(partial: Path, *, recovered: bool = False) -> SealResult:
    """Compact a closed (or crashed) partial into its sorted Parquet file, then remove the partial."""
    final = sealed_path_for(partial)
    if final.exists():  # sealed before a crash that left the partial behind
        partial.unlink(missing_ok=True)
        return SealResult(final, 0, 0, recovered)
    contents = read_partial(partial)
    rows, discarded = contents.table.num_rows, contents.discarded_bytes
    if rows == 0:
        partial.unlink(missing_ok=True)
        return SealResult(None, 0, discarded, recovered)
    table = contents.table.combine_chunks()  # one copy; the file's batches are let go
    del contents
    write_sealed(
        table,
        final,
        {
            b"rlreplay.recovered": b"true" if recovered else b"false",
            b"rlreplay.discarded_bytes": str(discarded).encode(),
        },
    )
    partial.unlink()
    return SealResult(final, rows, discarded, recovered)


def write_sealed(table: pa.Table, final: Path, extra_metadata: dict[bytes, bytes] | None = None) -> None:
    """Sort and write a sealed shard and its index durably: temp names, fsync, rename, directory fsync.

    Rows are sorted by index and taken one row group at a time, so writing needs ``table`` and one
    row group in memory, not a sorted copy of it."""
    if final.exists():
        raise FileExistsError(final)
    metadata = {**SPAN_SCHEMA.metadata, **(extra_metadata or {})}
    table = table.replace_schema_metadata(metadata).combine_chunks()
    order = ops.sort_indices(table, SORT_KEYS)
    sizes = ops.take(row_sizes(table), order)
    spans = ops.take(table.select(tindex.SPAN_COLUMNS), order)
    bounds = row_group_bounds(spans, sizes=sizes)
    row_group_of = [i for i, (a, b) in enumerate(bounds) for _ in range(b - a)]
    tmp = final.with_name("_" + final.name + ".tmp")
    with open(tmp, "xb") as f:
        writer = pq.ParquetWriter(
            f,
            table.schema,
            compression="zstd",
            compression_level=SEALED_ZSTD_LEVEL,
            use_dictionary=_DICTIONARY_COLUMNS,
            write_statistics=META_COLUMNS,
            use_byte_stream_split=["token_logprobs.list.element"],
            data_page_size=1 << 20,
        )
        for start, stop in bounds:
            writer.write_table(ops.take(table, order[start:stop]), row_group_size=stop - start)
        writer.close()
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    index = tindex.build(spans, row_group_of)
    tindex.write(index, tindex.index_path(final), size)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def row_sizes(table: pa.Table) -> pa.Array:
    """About how many payload bytes each row holds."""
    size = np.full(table.num_rows, 200, dtype=np.int64)
    for name in ("attributes", "inputs", "output"):
        size += ops.fill_null(ops.binary_length(table[name]), 0).to_numpy(zero_copy_only=False)
    for name, typ in TOKEN_COLUMNS.items():
        lengths = ops.fill_null(ops.list_value_length(table[name]), 0)
        size += lengths.to_numpy(zero_copy_only=False).astype(np.int64) * typ.byte_width
    return pa.array(size)


def row_group_bounds(
    table: pa.Table, target: int | None = None, sizes: pa.Array | None = None
) -> list[tuple[int, int]]:
    """[start, stop) row ranges of about ``target`` payload bytes, cut between trajectories
    (``sizes``: the rows' sizes, when ``table`` lacks the payload columns)."""
    target = ROW_GROUP_BYTES if target is None else target
    n = table.num_rows
    if n == 0:
        return []
    size = (row_sizes(table) if sizes is None else sizes).to_numpy()
    ids = table["trajectory_id"].to_numpy(zero_copy_only=False)
    cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1  # where a trajectory starts
    bounds, start, total = [], 0, 0
    cumulative = np.cumsum(size)
    for cut in cuts:
        total = cumulative[cut - 1] - (cumulative[start - 1] if start else 0)
        if total >= target:
            bounds.append((start, int(cut)))
            start = int(cut)
    bounds.append((start, n))
    return bounds


def step_dirs(run_dir: Path, step: int | None = None) -> Iterator[Path]:
    base = Path(run_dir) / SPANS_DIR
    if step is not None:
        candidate = base / f"step={step}"
        if candidate.is_dir():
            yield candidate
        return
    if not base.is_dir():
        return
    for entry in os.scandir(base):
        if entry.is_dir() and entry.name.startswith("step="):
            yield Path(entry.path)


def list_files(run_dir: Path, step: int | None = None) -> tuple[list[Path], list[Path]]:
    """(sealed files, live partials) of a run, optionally of one step only."""
    sealed: list[Path] = []
    partials: list[Path] = []
    for sdir in step_dirs(run_dir, step):
        for wdir in os.scandir(sdir):
            if not wdir.is_dir():
                continue
            for entry in os.scandir(wdir.path):
                name = entry.name
                if name.endswith(SEALED_SUFFIX) and not name.startswith(("_", ".")):
                    sealed.append(Path(entry.path))
                elif name.endswith(PARTIAL_SUFFIX) and name.startswith("_part-"):
                    partials.append(Path(entry.path))
    sealed.sort()
    partials.sort()
    sealed_set = set(sealed)
    partials = [p for p in partials if sealed_path_for(p) not in sealed_set]
    return sealed, partials


@dataclass
class Salvage:
    """What a damaged stream file still holds: its whole batches, and the byte ranges that are not."""

    table: pa.Table
    batches: int
    bad_ranges: list[tuple[int, int]]
    clean: bool  # ended with the end-of-stream marker


_CONTINUATION = b"\xff\xff\xff\xff"
_END_OF_STREAM = _CONTINUATION + b"\x00\x00\x00\x00"


def salvage_partial(path: Path) -> Salvage:
    """Every readable batch of a stream file, also after garbage in its middle (the reader resyncs
    at the next message marker); raises FormatError when even its header is unusable."""
    import mmap

    size = path.stat().st_size
    if size == 0:
        raise FormatError(f"{path}: empty file")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = pa.memory_map(str(path)).read_buffer(size)  # batches may point into it: arrow owns it
        try:
            src = pa.BufferReader(buf)
            schema = pa.ipc.read_schema(pa.ipc.read_message(src))
            header = buf.slice(0, src.tell())
        except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
            raise FormatError(f"{path}: unreadable stream header ({exc})") from exc
        version = file_version(schema, str(path))
        batches: list[pa.RecordBatch] = []
        bad: list[tuple[int, int]] = []
        pos = src.tell()
        clean = False
        while pos < size:
            if mm[pos : pos + 8] == _END_OF_STREAM and pos + 8 == size:
                clean = True
                break
            try:
                src.seek(pos)
                message = pa.ipc.read_message(src)
                if message.type != "record batch":
                    raise ValueError(f"unexpected {message.type} message")
                batch = _checked_batch(header, message)
                batch.validate(full=True)
                batches.append(batch)
                pos = src.tell()
            except (pa.ArrowException, OSError, EOFError, ValueError):
                following = mm.find(_CONTINUATION, pos + 1)
                end = size if following < 0 else following
                if bad and bad[-1][1] == pos:
                    bad[-1] = (bad[-1][0], end)
                else:
                    bad.append((pos, end))
                pos = end
        table = pa.Table.from_batches(batches, schema=schema)
    if version == 1:
        table = upgrade(table)
    return Salvage(table, len(batches), bad, clean)


def _checked_batch(header: pa.Buffer, message: pa.ipc.Message) -> pa.RecordBatch:
    """A record batch message read as a batch; ValueError if its body's CRC-32 (when written with
    one) does not match."""
    stream = pa.ipc.open_stream(pa.BufferReader(header.to_pybytes() + message.serialize().to_pybytes()))
    batch, metadata = stream.read_next_batch_with_custom_metadata()
    expected = metadata.get(BODY_CRC.encode()) if metadata is not None else None
    if expected is not None and int(expected) != zlib.crc32(message.body):
        raise ValueError("batch body does not match its checksum")
    return batch


@dataclass
class Recovered:
    """One file ``recover`` dealt with: what it kept (a sealed shard) and what it set aside, and why."""

    path: Path
    sealed: Path | None = None
    rows: int = 0
    set_aside: list[Path] | None = None
    set_aside_bytes: int = 0
    removed: bool = False  # a partial whose every row was already in its sealed file
    note: str = ""


@dataclass
class Recovery:
    files: list[Recovered]
    live: list[Path]  # still held by a running writer: left untouched

    @property
    def sealed(self) -> list[Recovered]:
        return [r for r in self.files if r.sealed is not None]


def _rel(run_dir: Path, path: Path) -> Path:
    return path.relative_to(run_dir)


def _quarantine_file(run_dir: Path, path: Path) -> Path:
    return quarantine(run_dir, path)


def _quarantine_ranges(run_dir: Path, partial: Path, ranges: list[tuple[int, int]]) -> list[Path]:
    """Copy the unreadable byte ranges of ``partial`` to the quarantine (durably), one file each."""
    out = []
    rel = _rel(run_dir, partial)
    with open(partial, "rb") as src:
        for start, end in ranges:
            target = safe_run_path(run_dir, QUARANTINE_DIR, rel.parent, f"{rel.name}.bytes-{start}-{end}")
            target.parent.mkdir(parents=True, exist_ok=True)
            src.seek(start)
            with open(target, "wb") as f:
                f.write(src.read(end - start))
                f.flush()
                os.fsync(f.fileno())
            out.append(target)
    if out:
        fsync_dir(out[0].parent)
    return out


def _sealed_rows(path: Path) -> int | None:
    """Rows of a readable rlreplay sealed file, None if it is not one."""
    try:
        pf = pq.ParquetFile(path)
        file_version(pf.schema_arrow, str(path))
        return pf.metadata.num_rows
    except (pa.ArrowException, OSError, FormatError, ValueError):
        return None


def recover_partial(run_dir: Path, partial: Path) -> Recovered:
    """Seal what a dead writer's partial holds; whatever cannot be read goes to ``RUN/_quarantine/``.

    Nothing is deleted unless every byte of it is kept elsewhere; nothing outside the run is touched.
    """
    result = Recovered(partial)
    safe_run_path(run_dir, _rel(run_dir, partial))
    final = sealed_path_for(partial)
    try:
        salvage = salvage_partial(partial)
    except (FormatError, OSError, ValueError) as exc:
        size = partial.stat().st_size
        result.set_aside = [_quarantine_file(run_dir, partial)]
        result.set_aside_bytes = size
        result.note = " ".join(str(exc).replace(str(partial), "").split()).strip(": ")[:160]
        return result
    rows = salvage.table.num_rows
    bad_bytes = sum(end - start for start, end in salvage.bad_ranges)
    if final.exists() or final.is_symlink():
        safe_run_path(run_dir, _rel(run_dir, final))
        existing = _sealed_rows(final)
        if existing is None:
            moved = _quarantine_file(run_dir, final)
            result.set_aside = [moved]
            result.note = f"a foreign or corrupt {final.name} stood in the way"
        elif existing == rows:  # sealed before a crash that left the partial behind
            result.set_aside = _quarantine_ranges(run_dir, partial, salvage.bad_ranges)
            result.set_aside_bytes = bad_bytes
            partial.unlink()
            result.removed = True
            result.note = f"already sealed in {final.name}"
            return result
        else:
            result.set_aside_bytes = partial.stat().st_size
            result.set_aside = [_quarantine_file(run_dir, partial)]
            result.note = f"{final.name} exists with {existing} rows, this file holds {rows}"
            return result
    if rows == 0 and salvage.bad_ranges:
        result.set_aside = [*(result.set_aside or []), _quarantine_file(run_dir, partial)]
        result.set_aside_bytes = bad_bytes
        result.note = "no readable batch"
        return result
    if rows:
        write_sealed(
            salvage.table,
            final,
            {
                b"rlreplay.recovered": b"true",
                b"rlreplay.discarded_bytes": str(bad_bytes).encode(),
            },
        )
        result.sealed, result.rows = final, rows
    if salvage.bad_ranges:
        result.set_aside = [
            *(result.set_aside or []),
            *_quarantine_ranges(run_dir, partial, salvage.bad_ranges),
        ]
        result.set_aside_bytes = bad_bytes
        ranges = len(salvage.bad_ranges)
        result.note = f"{ranges} unreadable byte range{'s' if ranges > 1 else ''}" + (
            " (a torn tail)" if ranges == 1 and salvage.bad_ranges[0][1] == partial.stat().st_size else ""
        )
    partial.unlink()
    result.removed = True
    return result


def recover_run(run_dir: Path, wait_s: float = 0.0) -> Recovery:
    """Seal every partial whose writer is gone; first wait up to ``wait_s`` for recording processes
    (their leases) to end, so that nothing is sealed while a process may still write.

    Partials still held open by a live writer are left untouched; so is anything that resolves
    outside the run directory (a symlinked folder).
    """
    run_dir = Path(run_dir)
    spans = Path(run_dir, SPANS_DIR)
    deadline = time.monotonic() + wait_s
    while live_leases(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    while True:
        partials = sorted(spans.glob(f"step=*/worker=*/_part-*{PARTIAL_SUFFIX}"))
        live = [p for p in partials if is_live(p)]
        if not live or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    files: list[Recovered] = []
    for tmp in spans.glob("step=*/worker=*/_part-*.index.tmp"):
        with contextlib.suppress(OSError):
            safe_run_path(run_dir, _rel(run_dir, tmp))
            tmp.unlink()  # an index written before its shard's rename: rebuilt when sealed again
    for tmp in sorted(spans.glob("step=*/worker=*/_part-*.parquet.tmp")):
        # a compaction that died before its rename: its rows are still in the partial
        partial = tmp.with_name(tmp.name[1:].removesuffix(SEALED_SUFFIX + ".tmp") + PARTIAL_SUFFIX)
        try:
            if partial.exists():
                safe_run_path(run_dir, _rel(run_dir, tmp))
                tmp.unlink()
            else:
                moved = _quarantine_file(run_dir, tmp)
                files.append(Recovered(tmp, set_aside=[moved], note="an unfinished compaction"))
        except (UnsafePathError, OSError) as exc:
            files.append(Recovered(tmp, note=f"left alone: {exc}"))
    for partial in partials:
        if partial in live or not partial.exists():
            continue
        try:
            files.append(recover_partial(run_dir, partial))
        except UnsafePathError:
            files.append(Recovered(partial, note="left alone: it resolves outside the run directory"))
        except (FormatError, OSError, pa.ArrowException, ValueError) as exc:
            files.append(Recovered(partial, note=f"left alone: {' '.join(str(exc).split())[:160]}"))
    return Recovery(files, live)


@dataclass
class RewriteResult:
    files: int
    spans: int
    source_bytes: int
    bytes: int


def rewrite_run(src: Path, dst: Path) -> RewriteResult:
    """Re-encode every span file of run ``src`` (format 1 or 2, sealed or live) into a new run
    ``dst`` in the current format, sealed; the manifest and worker counters are copied.

    Payloads are decoded and encoded again (typed token arrays, shared prefixes); every value
    reads back as before. ``dst`` must not exist yet.
    """
    import json
    import shutil

    from rlreplay import manifest, payload, rows, store
    from rlreplay.schema import FORMAT_VERSION

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists")
    run = store.open_run(src)
    dst.mkdir(parents=True)
    if (src / manifest.MANIFEST).exists():
        data = json.loads((src / manifest.MANIFEST).read_text())
        data["format_version"] = FORMAT_VERSION
        manifest.write_json_atomic(dst / manifest.MANIFEST, data)
    if (src / LEASE_DIR).is_dir():
        (dst / LEASE_DIR).mkdir()
        for path in (src / LEASE_DIR).glob("*.json"):
            shutil.copy2(path, dst / LEASE_DIR / path.name)
    sealed, partials = list_files(src)
    result = RewriteResult(0, 0, 0, 0)
    plain = [c for c in SPAN_SCHEMA.names if c not in TOKEN_COLUMNS and c not in ("inputs", "output")]
    for path in sealed + partials:
        is_sealed = path in sealed
        table = run._read_sealed(path, store.Filters(), None) if is_sealed else run._partial(path)
        if table is None:
            raise FormatError(f"{path}: unreadable ({'; '.join(run.warnings)})")
        here = set(table["span_id"].to_pylist())
        ids = list(dict.fromkeys(table["trajectory_id"].to_pylist()))
        originals = {r["span_id"]: r for r in table.select(plain).to_pylist()}
        out_rows = []
        for traj in run.load(ids):
            prefixes = payload.SharedIndex()
            for span in sorted(traj.spans, key=lambda s: (s.end_ns, s.start_ns)):
                arrays = payload.Arrays(prefixes)
                inputs = None if span.inputs is None else payload.dumps(arrays.extract(span.inputs))
                output = None if span.output is None else payload.dumps(arrays.extract(span.output))
                prefixes.add(span.span_id, arrays)
                if span.span_id not in here:
                    continue
                row = dict(originals[span.span_id])
                prompt, response = rows._token_counts(span.kind, span.inputs, span.output)
                if row["prompt_tokens"] is None:
                    row["prompt_tokens"] = prompt
                if row["response_tokens"] is None:
                    row["response_tokens"] = response
                row.update(inputs=inputs, output=output)
                row.update(zip(TOKEN_COLUMNS, arrays.columns()))
                out_rows.append(row)
        buf = rows.StepBuffer()
        for row in out_rows:
            buf.append(tuple(row[c] for c in SPAN_SCHEMA.names), 0)
        batch = buf.take_batch()
        final = dst / (path.relative_to(src) if is_sealed else sealed_path_for(path).relative_to(src))
        final.parent.mkdir(parents=True, exist_ok=True)
        extra = {}
        if is_sealed:
            metadata = pq.read_schema(path).metadata or {}
            extra = {
                k: v
                for k, v in metadata.items()
                if k.startswith(b"rlreplay.") and k != b"rlreplay.format_version"
            }
        write_sealed(pa.Table.from_batches([batch]), final, extra)
        result.files += 1
        result.spans += batch.num_rows
        result.source_bytes += path.stat().st_size
        result.bytes += final.stat().st_size
    return result
