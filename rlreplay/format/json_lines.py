"""Arrow columns as JSON texts, column by column: the bytes ``orjson.dumps`` gives for each value.

:func:`texts` encodes one column; :func:`lines` joins named text columns into one JSON object per
row. Both run in Arrow kernels (and one ``orjson`` call per column), not per row in Python.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import pyarrow as pa

#: Characters JSON writes escaped in a string; a string without them is itself between quotes.
_ESCAPED = r'["\\\x00-\x1f]'
#: At most this many distinct values are encoded one by one, then taken by index.
_FEW = 4096


def encode(values: list[Any]) -> pa.Array:
    """``orjson.dumps`` of each value (null stays null)."""
    return pa.array([None if v is None else orjson.dumps(v).decode() for v in values], type=pa.string())


def _numbers(values: pa.Array) -> pa.Array:
    """Floats as ``orjson`` writes them: one ``orjson`` call for the column, split at the commas
    (a number's text has none)."""
    import pyarrow.compute as pc

    if len(values) == 0:
        return pa.array([], type=pa.string())
    parts = orjson.dumps(values.to_pylist()).decode()[1:-1].split(",")
    return pc.if_else(pc.is_null(values), pa.scalar(None, pa.string()), pa.array(parts, pa.string()))


def _strings(values: pa.Array) -> pa.Array:
    """Strings between quotes; those with a character JSON escapes go through ``orjson``."""
    import pyarrow.compute as pc

    out = pc.binary_join_element_wise('"', values, '"', "")
    escaped = pc.match_substring_regex(values, _ESCAPED)
    if pc.any(escaped).as_py():
        picked = pc.take(values, pc.indices_nonzero(escaped))
        out = pc.replace_with_mask(out, pc.fill_null(escaped, False), encode(picked.to_pylist()))
    return out


def texts(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each value's JSON text as a string array; null where the value is null."""
    import pyarrow.compute as pc

    values = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = values.type
    if values.null_count == len(values):
        return pa.nulls(len(values), pa.string())
    if pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        return pc.cast(values, pa.string())
    if not (pa.types.is_floating(kind) or pa.types.is_string(kind)):
        return encode(values.to_pylist())
    coded = pc.dictionary_encode(values, null_encoding="mask")
    if len(coded.dictionary) <= _FEW:
        return pc.take(encode(coded.dictionary.to_pylist()), coded.indices)
    return _numbers(values) if pa.types.is_floating(kind) else _strings(values)


def lines(columns: Sequence[tuple[str, pa.Array]]) -> str:
    """One JSON object per row, newline-terminated, of the named text columns (from :func:`texts`;
    null writes ``null``), keys in the given order."""
    import pyarrow.compute as pc

    if not columns or len(columns[0][1]) == 0:
        return ""
    parts: list[Any] = []
    for i, (name, values) in enumerate(columns):
        parts.append(("{" if i == 0 else ",") + orjson.dumps(name).decode() + ":")
        parts.append(pc.fill_null(values, "null") if values.null_count else values)
    joined = pc.binary_join_element_wise(*parts, "}\n", "")
    offsets, data = joined.buffers()[1:3]
    first, last = (
        int.from_bytes(offsets[i * 4 : i * 4 + 4], "little", signed=True)
        for i in (joined.offset, joined.offset + len(joined))
    )
    return data[first:last].to_pybytes().decode()


def chunks(rows: int, size: int) -> Iterator[tuple[int, int]]:
    """``(offset, length)`` of consecutive slices of ``rows`` rows, ``size`` at most each."""
    for start in range(0, rows, size):
        yield start, min(size, rows - start)
