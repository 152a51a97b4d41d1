"""Sealing: a finished live file rewritten as a sorted, compressed Parquet shard with its index."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rlreplay.errors import DamagedFileError
from rlreplay.format import arrow_ops as ops
from rlreplay.format import checksums
from rlreplay.format import index as tindex
from rlreplay.format.schema import (
    KEY_STR,
    META_COLUMNS,
    SPAN_SCHEMA,
    TOKEN_COLUMNS,
)
from rlreplay.shards.layout import fsync_dir, sealed_path_for
from rlreplay.shards.live import read_partial

SEALED_ZSTD_LEVEL = 3
SORT_KEYS = [
    ("sample_index", "ascending"),
    (KEY_STR["sample_index"], "ascending"),
    ("rollout_n", "ascending"),
    (KEY_STR["rollout_n"], "ascending"),
    ("trajectory_id", "ascending"),
    ("start_ns", "ascending"),
]
#: Row groups of ~2 MiB of payload: zstd 3 finds in them what zstd 6 finds in 512 KiB ones (token ids
#: of real text), for half the sealing CPU; a trajectory read alone reads at most ~1 MB of them.
ROW_GROUP_BYTES = 2 << 20
_DICTIONARY_COLUMNS = ["trajectory_id", "name", "kind", "status", "experiment", "worker"]


@functools.cache
def sealing_pool() -> pa.MemoryPool:
    """The memory pool a seal's row groups and Parquet writer allocate from: jemalloc where pyarrow
    has it. Arrow's default pool (mimalloc) reserves arenas advised for transparent huge pages,
    where each first touch zeroes 2 MiB: a seal's fresh buffers cost a third more CPU there."""
    try:
        return pa.jemalloc_memory_pool()
    except NotImplementedError:  # a pyarrow built without jemalloc
        return pa.default_memory_pool()


@dataclass
class SealResult:
    sealed: Path | None
    rows: int
    discarded_bytes: int
    recovered: bool


def seal(partial: Path, *, recovered: bool = False) -> SealResult:
    """Compact a closed partial into its sorted Parquet file, then remove the partial. One that is
    not whole (a crash tore it) or does not match its checksums raises ``DamagedFileError`` and is
    left for ``recover``, which keeps aside what it cannot read."""
    final = sealed_path_for(partial)
    if final.exists():  # sealed before a crash that left the partial behind
        partial.unlink(missing_ok=True)
        return SealResult(final, 0, 0, recovered)
    contents = read_partial(partial)  # a batch that does not match its checksum: DamagedFileError
    if not contents.clean:  # bytes no batch holds: `recover` keeps them aside, never deletes them
        raise DamagedFileError(
            f"{partial.name}: {contents.discarded_bytes} bytes at its end are not a whole batch"
        )
    rows, discarded = contents.table.num_rows, contents.discarded_bytes
    if rows == 0:
        partial.unlink(missing_ok=True)
        return SealResult(None, 0, discarded, recovered)
    write_sealed(
        contents.table,
        final,
        {
            b"rlreplay.recovered": b"true" if recovered else b"false",
            b"rlreplay.discarded_bytes": str(discarded).encode(),
        },
    )
    del contents
    partial.unlink()
    return SealResult(final, rows, discarded, recovered)


def parquet_options() -> dict[str, Any]:
    """How a sealed shard's Parquet is written (``pq.ParquetWriter`` keywords)."""
    return {
        "compression": "zstd",
        "compression_level": SEALED_ZSTD_LEVEL,
        "use_dictionary": _DICTIONARY_COLUMNS,
        "write_statistics": META_COLUMNS,
        "use_byte_stream_split": ["token_logprobs.list.element"],
        "data_page_size": 1 << 20,
        "write_page_checksum": True,
    }


def write_sealed(
    table: pa.Table,
    final: Path,
    extra_metadata: dict[bytes, bytes] | None = None,
    row_group_bytes: int | None = None,
) -> None:
    """Sort and write a sealed shard and its index durably: temp names, fsync, rename, directory fsync;
    row groups of about ``row_group_bytes`` (default ``ROW_GROUP_BYTES``), cut between trajectories.

    ``table`` may be in chunks (the live file's batches, as written): each row group is gathered
    from them in sorted order, runs of consecutive rows at a time, so writing holds ``table`` and
    one row group, never a combined or sorted copy of the whole."""
    if final.exists():
        raise FileExistsError(final)
    metadata = {**SPAN_SCHEMA.metadata, **(extra_metadata or {})}
    table = table.replace_schema_metadata(metadata)
    order = ops.sort_indices(table, SORT_KEYS).to_numpy()
    spans = ops.take(table.select(tindex.SPAN_COLUMNS), order)
    bounds = row_group_bounds(spans, row_group_bytes, pa.array(row_sizes(table).to_numpy()[order]))
    row_group_of = np.repeat(np.arange(len(bounds)), [b - a for a, b in bounds]).tolist()
    tmp = final.with_name("_" + final.name + ".tmp")
    with open(tmp, "xb") as f:
        writer = pq.ParquetWriter(f, table.schema, memory_pool=sealing_pool(), **parquet_options())
        for start, stop in bounds:
            writer.write_table(_gather(table, order[start:stop]), row_group_size=stop - start)
        write_checksums(writer, f, tmp, len(bounds))
        os.fsync(f.fileno())
        size = f.tell()
    calls = tindex.answer_calls(table)[order]  # the tool calls model answers hold (their outputs)
    index = tindex.build(spans, row_group_of, calls)
    tindex.write(index, tindex.index_path(final), size)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def _gather(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table``'s ``rows`` in that order, as one copy: a slice per run of consecutive rows (rows
    arrive in the order their spans ended, a trajectory's mostly together), concatenated."""
    if len(rows) == 0:
        return table.slice(0, 0)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = rows[np.concatenate(([0], breaks))].tolist()
    lengths = np.diff(np.concatenate(([0], breaks, [len(rows)]))).tolist()
    parts = [table.slice(start, length) for start, length in zip(starts, lengths)]
    pool = sealing_pool()
    return pa.concat_tables(parts, memory_pool=pool).combine_chunks(memory_pool=pool)


def write_checksums(writer: pq.ParquetWriter, f: BinaryIO, path: Path, row_groups: int) -> None:
    """Close ``writer`` (writing into ``f``, the file at ``path``) with the checksums of its
    ``row_groups`` row groups and of its footer in the footer (``rlreplay.format.checksums``)."""
    checksums.reserve(writer, row_groups)
    writer.close()
    f.flush()
    checksums.fill(path)


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
