"""Live span files: the append-only Arrow IPC stream a recorder writes, and reading it back."""

from __future__ import annotations

import fcntl
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from rlreplay.errors import FormatError
from rlreplay.format.schema import (
    SPAN_SCHEMA,
    file_version,
    upgrade,
)
from rlreplay.shards.layout import PARTIAL_SUFFIX, new_uid
from rlreplay.shards.lease import open_writers

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


class PartialWriter:
    """An append-only Arrow IPC stream; every ``write`` that returns is readable after a crash.

    The file is ``flock``ed while open, so recovery can tell a live writer from a dead one.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"_part-{new_uid()}{PARTIAL_SUFFIX}"
        self._file = open(self.path, "xb")  # noqa: SIM115 - closed in close(); holds the lock
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        open_writers.add(self)
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

    def disown(self, devnull: int) -> None:
        """In a forked child: point this (the parent's) writer at ``devnull`` without writing to the
        file: closing it would flush the parent's buffered bytes into the parent's file."""
        if not self._file.closed:
            os.dup2(devnull, self._file.fileno())
            if not self._raw.closed:
                os.dup2(devnull, self._raw.fileno())

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


@dataclass
class PartialContents:
    table: pa.Table
    batches: int
    discarded_bytes: int
    clean: bool


def read_partial(path: Path) -> PartialContents:
    """Every whole batch of a stream file, stopping cleanly at a torn tail. The batches are read
    from a memory map of the file, in place (no copy: the file's pages are mapped, the fresh
    memory a copy would need costs more than the copy itself)."""
    size = path.stat().st_size
    batches: list[pa.RecordBatch] = []
    good_end = 0
    clean = False
    with pa.memory_map(str(path)) as f:
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
