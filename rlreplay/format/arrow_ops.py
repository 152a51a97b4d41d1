"""The Arrow compute kernels rlreplay's reading paths use, called without ``pyarrow.compute``.

``import pyarrow.compute`` writes a Python wrapper with a docstring for every kernel Arrow has
(~30 ms of each command's start-up); the kernels and their options live in the extension module
``pyarrow._compute``, which loads in a few ms. Each function here calls one kernel by name, with
the options ``pyarrow.compute`` would pass, so it gives that function's result. A pyarrow
without that module or one of its names: the same calls go through ``pyarrow.compute``.

Methods such as ``Table.filter``, ``Table.sort_by``, ``Table.take`` or ``Table.cast`` import
``pyarrow.compute`` themselves: reading code calls :func:`filter`, :func:`sort_by`, :func:`take`
and :func:`cast_table` instead, and :func:`from_numpy` for ``pa.array`` of a numpy array (which
imports ``numpy.ma``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

#: What the kernels are called through: its ``call_function`` and these options classes.
NAMES = (
    "call_function",
    "CastOptions",
    "DictionaryEncodeOptions",
    "FilterOptions",
    "MatchSubstringOptions",
    "ScalarAggregateOptions",
    "SetLookupOptions",
    "SortOptions",
    "TakeOptions",
)


def _kernels() -> Any:
    """``pyarrow._compute`` when it has every name, else ``pyarrow.compute`` (which re-exports them)."""
    try:
        import pyarrow._compute as kernels
    except ImportError:
        kernels = None
    if kernels is None or not all(hasattr(kernels, name) for name in NAMES):
        import pyarrow.compute as kernels
    return kernels


kernels = _kernels()
_call = kernels.call_function


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
    return _call("equal", [a, b])


def greater_equal(a: Any, b: Any) -> Any:
    return _call("greater_equal", [a, b])


def less_equal(a: Any, b: Any) -> Any:
    return _call("less_equal", [a, b])


def and_(a: Any, b: Any) -> Any:
    """Boolean and (null where either side is null, as ``pyarrow.compute.and_``)."""
    return _call("and", [a, b])


def or_(a: Any, b: Any) -> Any:
    return _call("or", [a, b])


def invert(a: Any) -> Any:
    return _call("invert", [a])


def is_null(a: Any) -> Any:
    return _call("is_null", [a])


def is_valid(a: Any) -> Any:
    return _call("is_valid", [a])


def is_in(values: Any, value_set: pa.Array) -> Any:
    """Whether each value is one of ``value_set`` (a null matches a null in the set)."""
    return _call("is_in", [values], kernels.SetLookupOptions(value_set))


def fill_null(values: Any, fill: Any) -> Any:
    """``values`` with nulls replaced by ``fill`` (a Python value is taken as of ``values``' type)."""
    if not isinstance(fill, (pa.Array, pa.ChunkedArray, pa.Scalar)):
        fill = pa.scalar(fill, type=values.type)
    elif fill.type != values.type:
        fill = pa.scalar(fill.as_py(), type=values.type)
    return _call("coalesce", [values, fill])


def coalesce(*values: Any) -> Any:
    """The first non-null value of each row."""
    return _call("coalesce", list(values))


def if_else(cond: Any, left: Any, right: Any) -> Any:
    return _call("if_else", [cond, left, right])


def starts_with(strings: Any, prefix: str) -> Any:
    return _call("starts_with", [strings], kernels.MatchSubstringOptions(prefix))


def binary_length(values: Any) -> Any:
    return _call("binary_length", [values])


def list_value_length(values: Any) -> Any:
    return _call("list_value_length", [values])


def cast(values: Any, target: pa.DataType) -> Any:
    """A safe cast (raises rather than lose values), as ``Array.cast``."""
    return _call("cast", [values], kernels.CastOptions.safe(target))


def cast_table(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table.cast(schema)``: the same column names, each column cast safely to its field's type;
    the schema's metadata. Raises ``ValueError`` when the names differ."""
    if table.schema.names != schema.names:
        raise ValueError(
            f"target schema's field names are not matching the table's field names: "
            f"{table.schema.names!r}, {schema.names!r}"
        )
    columns = [
        column if column.type == field.type else cast(column, field.type)
        for column, field in zip(table.columns, schema)
    ]
    return pa.Table.from_arrays(columns, schema=schema)


# ---- selection, order, aggregates --------------------------------------------------------------------


def take(data: Any, indices: Any) -> Any:
    """Rows (or values) of ``data`` at ``indices``; a null index gives a null row."""
    return _call("take", [data, indices], kernels.TakeOptions(boundscheck=True))


def filter(data: Any, mask: Any) -> Any:
    """Rows (or values) of ``data`` where ``mask`` is true; null counts as false."""
    return _call("filter", [data, mask], kernels.FilterOptions("drop"))


def sort_indices(data: Any, keys: Sequence[tuple[str, str]]) -> Any:
    """Indices of a stable sort by ``keys`` (``(column, "ascending"|"descending")``), nulls last."""
    return _call("sort_indices", [data], kernels.SortOptions(sort_keys=list(keys)))


def sort_by(table: pa.Table, keys: Sequence[tuple[str, str]]) -> pa.Table:
    """``table.sort_by(keys)``: a stable sort, nulls last."""
    return take(table, sort_indices(table, keys))


def dictionary_encode(values: Any) -> Any:
    """Values as indices into their distinct values, in order of first appearance (nulls stay null)."""
    return _call("dictionary_encode", [values], kernels.DictionaryEncodeOptions("mask"))


def unique(values: Any) -> Any:
    return _call("unique", [values])


def drop_null(values: Any) -> Any:
    return _call("drop_null", [values])


def sum(values: Any) -> pa.Scalar:
    """The sum of the non-null values (null when there are none)."""
    return _call("sum", [values], kernels.ScalarAggregateOptions())


def min(values: Any) -> pa.Scalar:
    """The least non-null value (null when there are none)."""
    return _call("min", [values], kernels.ScalarAggregateOptions())
