"""Checksums of the Parquet files rlreplay writes (sealed shards, their ``.index`` files, run index
segments), verified on every read.

Parquet's page CRCs cover page data only: not the page headers, not the footer (schema, row
group offsets, statistics, key-value metadata), where one changed byte can change what a read
returns without an error. So each file carries, in its footer's key-value metadata under
``rlreplay.crc32``, CRC-32s as 8 hex digits each: first the footer's own (computed with those 8
digits as zeros), then each column chunk's (every byte of it, page headers included), row group
by row group in the footer's order. A reader checks the footer when it opens a file
(:class:`CheckedParquet`) and each column chunk before it reads it; a mismatch raises
``DamagedFileError`` naming the file and the part of it.

Writing: :func:`reserve` makes room for the digits before the writer closes, :func:`fill` writes
them once it has (:func:`write_table` does both). Files written before checksums have no such
entry: they are read unverified (``CheckedParquet.verified`` is False), with Parquet's page CRCs
checked where they have them.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlreplay.errors import DamagedFileError

#: The footer's key-value entry holding the checksums.
KEY = b"rlreplay.crc32"
_DIGITS = 8
_ZERO = b"0" * _DIGITS
_MAGIC = b"PAR1"
_HEX = re.compile(rb"[0-9a-f]*")
#: The thrift compact header of a KeyValue's value field (field 2, a binary), after its key.
_VALUE_FIELD = b"\x18"
#: Bytes read from a file's end at once: most footers fit.
_TAIL_GUESS = 64 << 10

Read = Callable[[int, int], bytes]  # (bytes, offset) -> bytes, as NativeFile.read_at


# ---- writing ---------------------------------------------------------------------------------------


def _leaves(typ: pa.DataType) -> int:
    """Parquet leaf columns a field of type ``typ`` is stored as."""
    if pa.types.is_struct(typ):
        return sum(_leaves(typ.field(i).type) for i in range(typ.num_fields))
    if pa.types.is_map(typ):
        return _leaves(typ.key_type) + _leaves(typ.item_type)
    if isinstance(typ, (pa.ListType, pa.LargeListType, pa.FixedSizeListType)):
        return _leaves(typ.value_type)
    return 1


def reserve(writer: pq.ParquetWriter, row_groups: int) -> None:
    """Before ``writer.close()``: room in the footer for the checksums of ``row_groups`` row groups."""
    chunks = row_groups * sum(_leaves(field.type) for field in writer.schema)
    writer.add_key_value_metadata({KEY.decode(): (_ZERO * (1 + chunks)).decode()})


def fill(path: str | os.PathLike[str]) -> None:
    """Once the writer of ``path`` has closed (and its bytes are flushed): write the checksums into
    the room :func:`reserve` made, before the file is fsynced and renamed into place."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        name = os.fspath(path)
        start, footer = _footer(lambda n, at: os.pread(fd, n, at), size, name)
        found = _find(footer)
        if found is None:
            raise ValueError(f"{name}: no room for checksums (reserve() was not called)")
        at, room = found
        ranges = chunk_ranges(pq.read_metadata(name))
        if len(room) != _DIGITS * (1 + len(ranges)):
            raise ValueError(f"{name}: room for {len(room) // _DIGITS - 1} checksums, {len(ranges)} chunks")
        digits = b"".join(b"%08x" % zlib.crc32(os.pread(fd, length, offset)) for offset, length in ranges)
        footer = footer[:at] + _ZERO + digits + footer[at + len(room) :]
        os.pwrite(fd, b"%08x" % zlib.crc32(footer) + digits, start + at)
    finally:
        os.close(fd)


def write_table(
    table: pa.Table,
    path: str | os.PathLike[str],
    *,
    row_group_rows: int | None = None,
    durable: bool = False,
    **options: Any,
) -> None:
    """``pyarrow.parquet.write_table`` with checksums (and page CRCs): ``table`` in row groups of
    ``row_group_rows`` rows (default: one), written to ``path`` (replaced), fsynced when ``durable``."""
    n = table.num_rows
    size = max(row_group_rows or n, 1)
    bounds = [(a, min(a + size, n)) for a in range(0, n, size)] or [(0, 0)]
    with open(path, "wb") as f:
        writer = pq.ParquetWriter(f, table.schema, write_page_checksum=True, **options)
        for a, b in bounds:
            writer.write_table(table.slice(a, b - a), row_group_size=max(b - a, 1))
        reserve(writer, len(bounds))
        writer.close()
        f.flush()
        fill(path)
        if durable:
            os.fsync(f.fileno())


# ---- reading ---------------------------------------------------------------------------------------


def chunk_ranges(metadata: pq.FileMetaData) -> list[tuple[int, int]]:
    """(offset, bytes) of every column chunk, row group by row group."""
    out = []
    for i in range(metadata.num_row_groups):
        group = metadata.row_group(i)
        out += [_chunk_range(group.column(j)) for j in range(group.num_columns)]
    return out


def _chunk_range(column: pq.ColumnChunkMetaData) -> tuple[int, int]:
    start = column.data_page_offset
    if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
        start = column.dictionary_page_offset
    return start, column.total_compressed_size


def _footer(read: Read, size: int, name: str) -> tuple[int, bytes]:
    """(where the footer starts, the file's bytes from there to its end)."""
    if size < 12:
        raise DamagedFileError(f"{name}: {size} bytes, too short for a Parquet file")
    guess = min(size, _TAIL_GUESS)
    tail = read(guess, size - guess)
    if tail[-4:] != _MAGIC:
        raise DamagedFileError(f"{name}: no Parquet footer at its end")
    length = int.from_bytes(tail[-8:-4], "little")
    if length + 12 > size:
        raise DamagedFileError(f"{name}: its footer length ({length}) exceeds the file")
    start = size - 8 - length
    return start, tail[-(length + 8) :] if length + 8 <= guess else read(length + 8, start)


def _find(footer: bytes) -> tuple[int, bytes] | None:
    """(offset in ``footer``, bytes) of the checksums' value; None when the footer has none.

    The key-value list follows the row groups (whose statistics may hold any text), and only
    rlreplay's fixed strings follow it: the last occurrence of the key is the entry."""
    key = footer.rfind(KEY + _VALUE_FIELD)
    if key < 0:
        return None
    at = key + len(KEY) + len(_VALUE_FIELD)
    length = shift = 0
    for _ in range(5):  # a varint
        if at >= len(footer):
            return None
        byte = footer[at]
        at += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return at, footer[at : at + length]


def footer_checksums(read: Read, size: int, name: str) -> list[int] | None:
    """The column chunks' checksums of a file of ``size`` bytes (read through ``read``) once its
    footer matches its own; None when it was written without checksums."""
    footer = _footer(read, size, name)[1]
    found = _find(footer)
    if found is None:
        return None
    at, value = found
    if not value or len(value) % _DIGITS or not _HEX.fullmatch(value):
        raise DamagedFileError(f"{name}: its footer's checksums are malformed")
    if zlib.crc32(footer[:at] + _ZERO + footer[at + _DIGITS :]) != int(value[:_DIGITS], 16):
        raise DamagedFileError(f"{name}: its footer does not match its checksum")
    return [int(value[k : k + _DIGITS], 16) for k in range(_DIGITS, len(value), _DIGITS)]


class CheckedParquet:
    """A Parquet file opened with its footer verified; ``read`` and ``read_row_groups`` verify the
    column chunks they read first. ``source``: a path, or a random-access pyarrow file; ``name``:
    how errors name the file; ``owned``: close ``source`` on ``close`` (default: when a path)."""

    def __init__(
        self,
        source: str | os.PathLike[str] | pa.NativeFile,
        name: str | None = None,
        owned: bool | None = None,
    ) -> None:
        self.name = name or os.fspath(source)  # type: ignore[arg-type]
        path = isinstance(source, (str, os.PathLike))
        self._owned = path if owned is None else owned
        self.input: pa.NativeFile = pa.OSFile(os.fspath(source)) if path else source  # type: ignore[arg-type]
        self._done: set[int] = set()  # chunks verified
        try:
            self.sums = footer_checksums(self.input.read_at, self.input.size(), self.name)
            self.parquet = pq.ParquetFile(self.input, page_checksum_verification=self.sums is None)
            metadata = self.parquet.metadata
            if self.sums is None and KEY in (metadata.metadata or {}):
                raise DamagedFileError(f"{self.name}: its footer's checksums cannot be found")
            if self.sums is not None and len(self.sums) != metadata.num_row_groups * metadata.num_columns:
                raise DamagedFileError(f"{self.name}: its checksums do not fit its column chunks")
            self._tops = [
                self.parquet.schema.column(j).path.split(".")[0] for j in range(metadata.num_columns)
            ]
        except BaseException:
            self.close()
            raise

    @property
    def verified(self) -> bool:
        """Whether the file has checksums (files written before them are read unverified)."""
        return self.sums is not None

    @property
    def metadata(self) -> pq.FileMetaData:
        return self.parquet.metadata

    @property
    def schema_arrow(self) -> pa.Schema:
        return self.parquet.schema_arrow

    @property
    def num_row_groups(self) -> int:
        return self.parquet.num_row_groups

    def verify(self, row_groups: Iterable[int] | None = None, columns: Sequence[str] | None = None) -> None:
        """Check the column chunks of ``columns`` (default: all) in ``row_groups`` (default: all)."""
        if self.sums is None:
            return
        metadata = self.parquet.metadata
        width = metadata.num_columns
        wanted = None if columns is None else set(columns)
        leaves = [j for j in range(width) if wanted is None or self._tops[j] in wanted]
        for i in range(metadata.num_row_groups) if row_groups is None else row_groups:
            group = metadata.row_group(i)
            todo = [(j, *_chunk_range(group.column(j))) for j in leaves if i * width + j not in self._done]
            while todo:  # neighbouring chunks in one read
                first = todo[0][1]
                end = first + todo[0][2]
                n = 1
                while n < len(todo) and todo[n][1] == end:
                    end += todo[n][2]
                    n += 1
                data = memoryview(self.input.read_at(end - first, first))
                if len(data) != end - first:
                    raise DamagedFileError(f"{self.name}: shorter than its footer says")
                for j, offset, length in todo[:n]:
                    if zlib.crc32(data[offset - first : offset - first + length]) != self.sums[i * width + j]:
                        raise DamagedFileError(
                            f"{self.name}: row group {i}, column {group.column(j).path_in_schema}: "
                            "its bytes do not match their checksum"
                        )
                    self._done.add(i * width + j)
                todo = todo[n:]

    def read_row_groups(
        self, row_groups: Sequence[int], columns: Sequence[str] | None = None, **options: Any
    ) -> pa.Table:
        self.verify(row_groups, columns)
        return self.parquet.read_row_groups(
            list(row_groups), columns=None if columns is None else list(columns), **options
        )

    def read(self, columns: Sequence[str] | None = None, **options: Any) -> pa.Table:
        self.verify(None, columns)
        return self.parquet.read(columns=None if columns is None else list(columns), **options)

    def close(self) -> None:
        if self._owned and not self.input.closed:
            self.input.close()

    def __enter__(self) -> CheckedParquet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_table(path: str | os.PathLike[str], columns: Sequence[str] | None = None) -> pa.Table:
    """A whole Parquet file (``columns`` of it), verified; threads cost more than they save on the
    small files this is for. All its columns wanted: its bytes are read at once (one read where
    the footer, the checksums and the pages would each read their part)."""
    source: str | os.PathLike[str] | pa.NativeFile = path
    if columns is None:
        with open(path, "rb") as f:
            source = pa.BufferReader(f.read())
    with CheckedParquet(source, name=os.fspath(path)) as f:
        return f.read(columns, use_threads=False)
