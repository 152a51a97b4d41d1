"""Span files on disk: live append-only streams, their compaction, and recovery after a crash.

Layout under a run directory::

    spans/step=5/worker=w0/_part-<uid>.partial   live Arrow IPC stream (zstd 1), ignored by scans
    spans/step=5/worker=w0/part-<uid>.parquet    sealed: sorted, Parquet zstd, queryable
    spans/step=5/worker=w0/part-<uid>.index      its trajectory index (``rlreplay.index``)

Sealed files are cut into row groups at trajectory boundaries (about ``ROW_GROUP_BYTES`` of
payload each), so one trajectory is read without the rest of its step.

A sealed file is written under a temporary name, fsynced and renamed; names are never reused,
and the partial is deleted only once its sealed file is durable.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlreplay import index as tindex
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
LIVE_ZSTD_LEVEL = 1
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
    return f"{time.time_ns():x}-{os.getpid()}-{secrets.token_hex(3)}"


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
        self._file = open(self.path, "xb")  # noqa: SIM115 - closed in close()
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        _open_writers.add(self)
        options = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", LIVE_ZSTD_LEVEL))
        self._writer = pa.ipc.new_stream(self._file, SPAN_SCHEMA, options=options)
        self.rows = 0
        self._dirty = False

    def write(self, batch: pa.RecordBatch) -> None:
        self._writer.write_batch(batch)
        self._file.flush()
        self.rows += batch.num_rows
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
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


class Lease:
    """A lock a recording process holds for its whole life, so recovery can wait for it to end."""

    def __init__(self, run_dir: Path) -> None:
        folder = Path(run_dir) / LEASE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"_lease-{new_uid()}.lock"
        self._file = open(self.path, "xb")  # noqa: SIM115 - closed in release()
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        _open_writers.add(self)

    def release(self) -> None:
        if not self._file.closed:
            self.path.unlink(missing_ok=True)
            self._file.close()


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
    os.close(devnull)
    _open_writers.clear()


os.register_at_fork(after_in_child=_release_inherited_writers)


def is_live(partial: Path) -> bool:
    """Whether a writer process still holds this partial open."""
    try:
        with open(partial, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            return False
    except FileNotFoundError:
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
    if contents.table.num_rows == 0:
        partial.unlink(missing_ok=True)
        return SealResult(None, 0, contents.discarded_bytes, recovered)
    write_sealed(
        contents.table,
        final,
        {
            b"rlreplay.recovered": b"true" if recovered else b"false",
            b"rlreplay.discarded_bytes": str(contents.discarded_bytes).encode(),
        },
    )
    partial.unlink()
    return SealResult(final, contents.table.num_rows, contents.discarded_bytes, recovered)


def write_sealed(table: pa.Table, final: Path, extra_metadata: dict[bytes, bytes] | None = None) -> None:
    """Sort and write a sealed shard and its index durably: temp names, fsync, rename, directory fsync."""
    if final.exists():
        raise FileExistsError(final)
    metadata = {**SPAN_SCHEMA.metadata, **(extra_metadata or {})}
    table = table.sort_by(SORT_KEYS).replace_schema_metadata(metadata).combine_chunks()
    bounds = row_group_bounds(table)
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
            writer.write_table(table.slice(start, stop - start), row_group_size=stop - start)
        writer.close()
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    index = tindex.build(table.select(tindex.SPAN_COLUMNS), row_group_of)
    tindex.write(index, tindex.index_path(final), size)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def row_group_bounds(table: pa.Table, target: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) row ranges of about ``target`` payload bytes, cut between trajectories."""
    target = ROW_GROUP_BYTES if target is None else target
    n = table.num_rows
    if n == 0:
        return []
    size = np.full(n, 200, dtype=np.int64)
    for name in ("attributes", "inputs", "output"):
        size += pc.fill_null(pc.binary_length(table[name]), 0).to_numpy(zero_copy_only=False)
    for name, typ in TOKEN_COLUMNS.items():
        lengths = pc.fill_null(pc.list_value_length(table[name]), 0)
        size += lengths.to_numpy(zero_copy_only=False).astype(np.int64) * typ.byte_width
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


def recover_run(run_dir: Path, wait_s: float = 0.0) -> tuple[list[SealResult], list[Path]]:
    """Seal every partial whose writer is gone; first wait up to ``wait_s`` for recording processes
    (their leases) to end, so that nothing is sealed while a process may still write.

    Returns the seal results and the partials still held open by a live writer (left untouched).
    """
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
    for pattern in ("_part-*.parquet.tmp", "_part-*.index.tmp"):
        for tmp in spans.glob(f"step=*/worker=*/{pattern}"):
            tmp.unlink(missing_ok=True)  # a compaction that died before its rename
    results = []
    for partial in partials:
        if partial in live or not partial.exists():
            continue
        try:
            results.append(seal(partial, recovered=True))
        except (FormatError, OSError, pa.ArrowException):
            continue  # left in place; readers skip it with a warning
    return results, live


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
