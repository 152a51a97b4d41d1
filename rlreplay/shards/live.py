"""Live span files: the append-only Arrow IPC stream a recorder writes, and reading it back."""

from __future__ import annotations

import fcntl
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlreplay.errors import DamagedFileError, FormatError
from rlreplay.format.schema import (
    SPAN_SCHEMA,
    file_version,
    upgrade,
)
from rlreplay.shards.layout import PARTIAL_SUFFIX, new_uid
from rlreplay.shards.lease import open_writers

#: Live files are not compressed (read once, when sealed to Parquet zstd): a codec costs per IPC
#: buffer (~60 per batch) whatever its size, lz4 ~1 ms per small batch against ~40 us uncompressed,
#: for ~1% fewer bytes (ids and log-probs barely compress). Each batch carries a CRC-32 instead
#: (Arrow's frames have none), so a damaged batch is refused and set aside, never misread: of its
#: IPC message header (lengths, null counts, buffer offsets: how the body decodes) and body.
BATCH_CRC = "rlreplay.batch_crc32"
#: What files written before carry: the CRC-32 of the body alone.
BODY_CRC = "rlreplay.body_crc32"


def live_options() -> pa.ipc.IpcWriteOptions:
    """IPC options of live files."""
    return pa.ipc.IpcWriteOptions(compression=None)


def batch_crc(batch: pa.RecordBatch) -> int:
    """The CRC-32 of a batch's IPC message as it is written (without custom metadata): its header,
    then its uncompressed body."""
    message = pa.ipc.read_message(batch.serialize())
    return zlib.crc32(message.body, zlib.crc32(message.metadata))


def body_crc(batch: pa.RecordBatch) -> dict[str, str]:
    """The custom metadata a live batch is written with: its checksum (:func:`batch_crc`)."""
    return {BATCH_CRC: str(batch_crc(batch))}


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
    #: every batch carried its checksum (files written before checksums: False)
    verified: bool = True


def read_partial(path: Path) -> PartialContents:
    """Every whole batch of a stream file, stopping cleanly at a torn tail (what a writer that is
    still writing, or that died mid-write, leaves). The batches are read from a memory map of the
    file, in place (no copy: the file's pages are mapped, the fresh memory a copy would need costs
    more than the copy itself).

    The stream's header must be the span schema, and each batch match the CRC-32 it was written
    with (:func:`check_batch`); where either does not, or where readable batches follow bytes
    that cannot be read (damage, not a torn tail), ``DamagedFileError`` names the file."""
    size = path.stat().st_size
    batches: list[pa.RecordBatch] = []
    good_end = 0
    clean = False
    checked = 0
    with pa.memory_map(str(path)) as f:
        try:
            reader = pa.ipc.open_stream(f)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise FormatError(f"{path}: unreadable stream header ({exc})") from exc
        version = check_header(reader.schema, str(path))
        good_end = f.tell()
        if good_end != reader.schema.serialize().size:  # its length prefix changed: it ate batches
            raise DamagedFileError(f"{path}: its header is not as long as its schema")
        while True:
            try:
                batch, metadata = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                clean = True
                good_end = size
                break
            except (pa.ArrowException, OSError, EOFError, ValueError):
                break
            checked += check_batch(batch, metadata, f"{path}: batch {len(batches)} (at byte {good_end})")
            batches.append(batch)
            good_end = f.tell()
        schema = reader.schema
    if checked and checked != len(batches):
        raise DamagedFileError(f"{path}: a batch has lost its checksum")
    if not clean and good_end < size and readable_after(path, good_end):
        raise DamagedFileError(f"{path}: bytes {good_end}.. cannot be read, and whole batches follow them")
    table = pa.Table.from_batches(batches, schema=schema)
    if version == 1:
        table = upgrade(table)
    discarded = 0 if clean else max(0, size - good_end)
    return PartialContents(table, len(batches), discarded, clean, verified=checked == len(batches))


def check_header(schema: pa.Schema, source: str) -> int:
    """The format version of a live file's header; ``DamagedFileError`` when its fields are not
    that version's (a changed byte there would change how every batch reads)."""
    try:
        version = file_version(schema, source)
    except ValueError as exc:  # a field name that is no longer text
        raise DamagedFileError(f"{source}: its header cannot be read ({exc})") from None
    if version >= 2 and not schema.equals(SPAN_SCHEMA, check_metadata=False):
        raise DamagedFileError(f"{source}: its header does not match the span schema")
    return version


def check_batch(batch: pa.RecordBatch, metadata: Any, where: str) -> bool:
    """Whether a batch read from a live file carries its checksum (files written before checksums
    do not); ``DamagedFileError`` (naming ``where``) when it does not match.

    The batch as decoded is serialized again and checked (:func:`batch_crc`): a changed byte in
    its body, or in the message header that says how the body decodes, gives another message."""
    found = dict(metadata) if metadata is not None else {}
    expected = found.get(BATCH_CRC.encode())
    body_only = expected is None and BODY_CRC.encode() in found
    if expected is None and not body_only:
        return False
    try:
        if body_only:  # written before headers were checked: the body, and a full validation
            expected = found[BODY_CRC.encode()]
            batch.validate(full=True)
            actual = zlib.crc32(pa.ipc.read_message(batch.serialize()).body)
        else:
            batch.validate()
            actual = batch_crc(batch)
        ok = expected.isdigit() and int(expected) == actual
    except (pa.ArrowException, ValueError):
        ok = False
    if not ok:
        raise DamagedFileError(f"{where}: its bytes do not match their checksum")
    return True


_CONTINUATION = b"\xff\xff\xff\xff"
_END_OF_STREAM = _CONTINUATION + b"\x00\x00\x00\x00"


def readable_after(path: Path, start: int) -> bool:
    """Whether a whole batch (its checksum matching) begins somewhere after byte ``start``: bytes
    that cannot be read with batches after them are damage, not a torn tail."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        src = pa.BufferReader(data)
        header = data[: _header_end(src)]
    except (pa.ArrowException, OSError, EOFError, ValueError):
        return False
    at = data.find(_CONTINUATION, start + 1)
    while 0 <= at < len(data) - 8:
        try:
            src = pa.BufferReader(data)
            src.seek(at)
            message = pa.ipc.read_message(src)
            if message.type == "record batch":
                batch_of(header, message)
                return True
        except (pa.ArrowException, OSError, EOFError, ValueError):
            pass
        at = data.find(_CONTINUATION, at + 1)
    return False


def _header_end(src: pa.BufferReader) -> int:
    """Where the stream's schema message ends."""
    pa.ipc.read_schema(pa.ipc.read_message(src))
    return src.tell()


def batch_of(header: bytes, message: pa.ipc.Message) -> pa.RecordBatch:
    """A record batch message read as a batch, checked (:func:`check_batch`); ValueError (a
    ``DamagedFileError``) when it does not match its checksum."""
    stream = pa.ipc.open_stream(pa.BufferReader(header + message.serialize().to_pybytes()))
    batch, metadata = stream.read_next_batch_with_custom_metadata()
    check_batch(batch, metadata, "batch")
    return batch


@dataclass
class Salvage:
    """What a damaged stream file still holds: its whole batches, and the byte ranges that are not."""

    table: pa.Table
    batches: int
    bad_ranges: list[tuple[int, int]]
    clean: bool  # ended with the end-of-stream marker


def salvage_partial(path: Path) -> Salvage:
    """Every readable batch of a stream file, also after garbage in its middle (the reader resyncs
    at the next message marker); a batch that does not match its checksum is one of the bad ranges.
    Raises FormatError when even its header is unusable."""
    import mmap

    size = path.stat().st_size
    if size == 0:
        raise FormatError(f"{path}: empty file")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = pa.memory_map(str(path)).read_buffer(size)  # batches may point into it: arrow owns it
        try:
            src = pa.BufferReader(buf)
            schema = pa.ipc.read_schema(pa.ipc.read_message(src))
            header = buf.slice(0, src.tell()).to_pybytes()
            version = check_header(schema, str(path))
        except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
            raise FormatError(f"{path}: unreadable stream header ({exc})") from exc
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
                batch = batch_of(header, message)
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
