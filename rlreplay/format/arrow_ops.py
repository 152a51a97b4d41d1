"""The Arrow compute kernels rlreplay's reading paths use, called through ``pyarrow.compute``.

Each function gives what the ``pyarrow.compute`` function (or the pyarrow method) of its name
gives. ``pyarrow.compute`` is imported inside the functions that call a kernel, not when this
module loads: a command that never calls one (``--help``, a listing of every trajectory) does
not pay for its import.

:func:`from_numpy` gives ``pa.array`` of a numpy array without its check for a numpy masked
array (which imports ``numpy.ma``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa


def from_numpy(values: Any, null: Any = None) -> pa.Array:
    """A 1-d numpy array of numbers or bools as an Arrow array, null where ``null`` is true: what
    ``pa.array(values, mask=null)`` gives, without its check for a numpy masked array (which
    imports ``numpy.ma``, ~9 ms of start-up). Numbers are wrapped, not copied."""
    import numpy as np

    values = np.ascontiguousarray(values)
    if values.ndim != 1 or values.dtype.kind not in "biuf":
        raise TypeError(
            f"from_numpy takes a 1-d array of numbers or bools, not {values.dtype} {values.shape}"
        )
    if values.dtype.kind == "b":
        dtype, data = pa.bool_(), pa.py_buffer(np.packbits(values, bitorder="little"))
    else:
        dtype, data = pa.from_numpy_dtype(values.dtype), pa.py_buffer(values)
    nulls = 0 if null is None else int(np.count_nonzero(null))
    validity = pa.py_buffer(np.packbits(~np.asarray(null, bool), bitorder="little")) if nulls else None
    return pa.Array.from_buffers(dtype, len(values), [validity, data], null_count=nulls)


# ---- element-wise ----------------------------------------------------------------------------------


def equal(a: Any, b: Any) -> Any:
    import pyarrow.compute as pc

    return pc.equal(a, b)


def greater_equal(a: Any, b: Any) -> Any:
    import pyarrow.compute as pc

    return pc.greater_equal(a, b)


def less_equal(a: Any, b: Any) -> Any:
    import pyarrow.compute as pc

    return pc.less_equal(a, b)


def and_(a: Any, b: Any) -> Any:
    """Boolean and (null where either side is null, as ``pyarrow.compute.and_``)."""
    import pyarrow.compute as pc

    return pc.and_(a, b)


def or_(a: Any, b: Any) -> Any:
    import pyarrow.compute as pc

    return pc.or_(a, b)


def invert(a: Any) -> Any:
    import pyarrow.compute as pc

    return pc.invert(a)


def is_null(a: Any) -> Any:
    import pyarrow.compute as pc

    return pc.is_null(a)


def is_valid(a: Any) -> Any:
    import pyarrow.compute as pc

    return pc.is_valid(a)


def is_in(values: Any, value_set: pa.Array) -> Any:
    """Whether each value is one of ``value_set`` (a null matches a null in the set)."""
    import pyarrow.compute as pc

    return pc.is_in(values, value_set=value_set)


def index_in(values: Any, value_set: pa.Array) -> Any:
    """The position of each value in ``value_set`` (null when absent)."""
    import pyarrow.compute as pc

    return pc.index_in(values, value_set=value_set)


def match_substring(strings: Any, pattern: str) -> Any:
    """Whether each string holds ``pattern`` (a plain substring)."""
    import pyarrow.compute as pc

    return pc.match_substring(strings, pattern=pattern)


def match_substring_regex(strings: Any, pattern: str) -> Any:
    """Whether each string holds a match of ``pattern`` (an RE2 regular expression)."""
    import pyarrow.compute as pc

    return pc.match_substring_regex(strings, pattern=pattern)


def fill_null(values: Any, fill: Any) -> Any:
    """``values`` with nulls replaced by ``fill`` (a Python value is taken as of ``values``' type)."""
    import pyarrow.compute as pc

    return pc.fill_null(values, fill)


def coalesce(*values: Any) -> Any:
    """The first non-null value of each row."""
    import pyarrow.compute as pc

    return pc.coalesce(*values)


def if_else(cond: Any, left: Any, right: Any) -> Any:
    import pyarrow.compute as pc

    return pc.if_else(cond, left, right)


def starts_with(strings: Any, prefix: str) -> Any:
    import pyarrow.compute as pc

    return pc.starts_with(strings, pattern=prefix)


def binary_length(values: Any) -> Any:
    import pyarrow.compute as pc

    return pc.binary_length(values)


def list_value_length(values: Any) -> Any:
    import pyarrow.compute as pc

    return pc.list_value_length(values)


def cast(values: Any, target: pa.DataType) -> Any:
    """A safe cast (raises rather than lose values), as ``Array.cast``."""
    import pyarrow.compute as pc

    return pc.cast(values, target, safe=True)


def cast_table(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table.cast(schema)``: the same column names, each column cast safely to its field's type;
    the schema's metadata. Raises ``ValueError`` when the names differ."""
    if table.schema.names != schema.names:
        raise ValueError(
            f"target schema's field names are not matching the table's field names: "
            f"{table.schema.names!r}, {schema.names!r}"
        )
    if table.schema.equals(schema):  # the same types: only the metadata changes
        return table.replace_schema_metadata(schema.metadata)
    columns = [
        column if column.type == field.type else cast(column, field.type)
        for column, field in zip(table.columns, schema)
    ]
    return pa.Table.from_arrays(columns, schema=schema)


# ---- selection, order, aggregates --------------------------------------------------------------------


def take(data: Any, indices: Any) -> Any:
    """Rows (or values) of ``data`` at ``indices``; a null index gives a null row."""
    import pyarrow.compute as pc

    return pc.take(data, indices, boundscheck=True)


def filter(data: Any, mask: Any) -> Any:
    """Rows (or values) of ``data`` where ``mask`` is true; null counts as false."""
    import pyarrow.compute as pc

    return pc.filter(data, mask, null_selection_behavior="drop")


def sort_indices(data: Any, keys: Sequence[tuple[str, str]]) -> Any:
    """Indices of a stable sort by ``keys`` (``(column, "ascending"|"descending")``), nulls last."""
    import pyarrow.compute as pc

    return pc.sort_indices(data, sort_keys=list(keys))


def sort_by(table: pa.Table, keys: Sequence[tuple[str, str]]) -> pa.Table:
    """``table.sort_by(keys)``: a stable sort, nulls last."""
    return take(table, sort_indices(table, keys))


def dictionary_encode(values: Any) -> Any:
    """Values as indices into their distinct values, in order of first appearance (nulls stay null)."""
    import pyarrow.compute as pc

    return pc.dictionary_encode(values, null_encoding="mask")


def unique(values: Any) -> Any:
    import pyarrow.compute as pc

    return pc.unique(values)


def drop_null(values: Any) -> Any:
    import pyarrow.compute as pc

    return pc.drop_null(values)


def sum(values: Any) -> pa.Scalar:
    """The sum of the non-null values (null when there are none)."""
    import pyarrow.compute as pc

    return pc.sum(values)


def min(values: Any) -> pa.Scalar:
    """The least non-null value (null when there are none)."""
    import pyarrow.compute as pc

    return pc.min(values)


def release_unused() -> None:
    """Hand the memory Arrow has freed back to the system (its allocator keeps it otherwise)."""
    pa.default_memory_pool().release_unused()
