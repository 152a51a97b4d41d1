"""``rlreplay.format.arrow_ops`` gives what ``pyarrow.compute`` (and the pyarrow methods that call it) give,
nulls included."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from rlreplay.format import arrow_ops as ops

INTS = pa.chunked_array([[3, None, 1], [2, 2, None]], pa.int64())
FLOATS = pa.array([0.5, None, -1.5, 2.0, None, 0.0])
STRS = pa.chunked_array([["ab", None], ["a", "ba", "abc", None]])
LISTS = pa.array([[1, 2], None, [], [3], None, [4, 5, 6]], pa.list_(pa.int32()))
BYTES = pa.array([b"xy", None, b"", b"z", None, b"abc"], pa.binary())
A = pa.array([True, False, None, True, None, False])
B = pa.chunked_array([[True, None, None], [False, True, False]])
TABLE = pa.table(
    {
        "k": pa.array([2, None, 1, 2, None, 1], pa.int64()),
        "s": pa.array(["x", "y", None, "a", "b", "c"]),
        "v": FLOATS,
    }
)
INDICES = pa.array([5, None, 0, 0, 3], pa.int64())

#: Each function of the module with the same name in ``pyarrow.compute``: arguments to call both with.
SAME_AS_PC: list[tuple[str, tuple[Any, ...]]] = [
    ("equal", (INTS, 2)),
    ("equal", (STRS, "ab")),
    ("greater_equal", (INTS, 2)),
    ("less_equal", (FLOATS, 0.5)),
    ("and_", (A, B)),
    ("or_", (A, B)),
    ("invert", (B,)),
    ("is_null", (STRS,)),
    ("is_valid", (FLOATS,)),
    ("is_in", (INTS, pa.array([1, 3], pa.int64()))),
    ("is_in", (STRS, pa.array(["ab", None]))),
    ("fill_null", (INTS, 0)),
    ("fill_null", (B, False)),
    ("fill_null", (STRS, "")),
    ("fill_null", (FLOATS, pa.scalar(7, pa.int64()))),
    ("coalesce", (INTS, pa.chunked_array([[9, 9, None], [None, 8, 8]], pa.int64()))),
    ("coalesce", (FLOATS, FLOATS)),
    ("if_else", (A, FLOATS, pa.array([1.0] * 6))),
    ("if_else", (A, pa.array(["t"] * 6), None)),
    ("starts_with", (STRS, "ab")),
    ("match_substring", (STRS, "b")),
    ("match_substring_regex", (STRS, "^a.?b")),
    ("index_in", (STRS, pa.array(["c", "ab", "y"]))),
    ("index_in", (INTS, pa.array([2, 1], pa.int64()))),
    ("binary_length", (BYTES,)),
    ("binary_length", (STRS,)),
    ("list_value_length", (LISTS,)),
    ("cast", (INTS, pa.string())),
    ("cast", (pa.array([1, None, 3], pa.int32()), pa.int64())),
    ("take", (TABLE, INDICES)),
    ("take", (STRS, INDICES)),
    ("filter", (TABLE, A)),
    ("filter", (INTS, B)),
    ("sort_indices", (TABLE, [("k", "ascending"), ("s", "descending")])),
    ("sort_indices", (TABLE, [("v", "descending")])),
    ("dictionary_encode", (STRS,)),
    ("dictionary_encode", (pa.array(["b", "a", None, "b"]),)),
    ("unique", (INTS,)),
    ("unique", (STRS,)),
    ("drop_null", (FLOATS,)),
    ("sum", (INTS,)),
    ("sum", (pa.array([None, None], pa.int64()),)),
    ("min", (FLOATS,)),
    ("min", (pa.array([], pa.int64()),)),
]

#: Functions standing for a pyarrow method (or ``pa.array``): checked by their own tests below.
OWN_TESTS = {"cast_table", "sort_by", "from_numpy", "release_unused"}


def same(ours: Any, theirs: Any) -> bool:
    kind = (lambda x: x.schema) if isinstance(ours, pa.Table) else (lambda x: x.type)
    return type(ours) is type(theirs) and kind(ours) == kind(theirs) and ours.equals(theirs)


def check_same_as_pc() -> None:
    for name, args in SAME_AS_PC:
        ours, theirs = getattr(ops, name)(*args), getattr(pc, name)(*args)
        assert same(ours, theirs), (name, args, ours, theirs)


def test_every_function_is_compared() -> None:
    functions = inspect.getmembers(ops, inspect.isfunction)
    public = {n for n, f in functions if f.__module__ == ops.__name__ and not n.startswith("_")}
    assert public == {n for n, _ in SAME_AS_PC} | OWN_TESTS


def test_each_function_gives_what_pyarrow_compute_gives() -> None:
    check_same_as_pc()


def test_sort_by_is_table_sort_by_stable_and_nulls_last() -> None:
    table = TABLE.append_column("i", pa.array(range(TABLE.num_rows)))
    for keys in ([("k", "ascending")], [("k", "descending"), ("v", "ascending")], [("s", "descending")]):
        ours = ops.sort_by(table, keys)
        assert ours.equals(table.sort_by(keys))
    # ties keep their order; nulls come last either way
    assert ops.sort_by(table, [("k", "ascending")])["i"].to_pylist() == [2, 5, 0, 3, 1, 4]
    assert ops.sort_by(table, [("k", "descending")])["i"].to_pylist() == [0, 3, 2, 5, 1, 4]


def test_cast_table_is_table_cast() -> None:
    schema = pa.schema(
        [pa.field("k", pa.int32()), pa.field("s", pa.string()), pa.field("v", pa.float32())],
        metadata={b"a": b"b"},
    )
    ours = ops.cast_table(TABLE, schema)
    assert ours.equals(TABLE.cast(schema), check_metadata=True)
    assert ours.schema.metadata == {b"a": b"b"}
    with pytest.raises(ValueError):
        ops.cast_table(TABLE, pa.schema([pa.field("k", pa.int64())]))
    with pytest.raises(pa.ArrowInvalid):  # a safe cast: no value is lost silently
        ops.cast_table(pa.table({"k": [2**40]}), pa.schema([pa.field("k", pa.int32())]))


@pytest.mark.parametrize(
    "values",
    [
        np.array([3, -1, 0, 2**40], np.int64),
        np.array([3, 1, 0, 7], np.int32),
        np.array([0.5, -1.0, np.inf, 1e300]),
        np.array([True, False, True, True, False, False, True, False, True]),
        np.arange(20, dtype=np.int64)[::3],  # not contiguous
        np.array([], np.int64),
    ],
    ids=["int64", "int32", "float64", "bool", "strided", "empty"],
)
def test_from_numpy_is_pa_array(values: np.ndarray) -> None:
    assert same(ops.from_numpy(values), pa.array(values))
    null = np.arange(len(values)) % 3 == 1
    ours = ops.from_numpy(values, null)
    assert same(ours, pa.array(values, mask=null))
    assert ours.null_count == int(null.sum())
    assert same(ops.from_numpy(values, np.zeros(len(values), bool)), pa.array(values))


def test_from_numpy_keeps_nan_a_value() -> None:
    values = np.array([np.nan, 1.0])
    ours, theirs = ops.from_numpy(values), pa.array(values)
    assert ours.null_count == theirs.null_count == 0
    assert np.isnan(ours[0].as_py()) and np.isnan(theirs[0].as_py())


def test_from_numpy_refuses_what_it_does_not_wrap() -> None:
    for values in (np.array(["ok", "error"]), np.array([[1, 2]]), np.array([None, 1], object)):
        with pytest.raises(TypeError):
            ops.from_numpy(values)


def test_release_unused_keeps_what_is_still_in_use() -> None:
    import numpy as np

    pool = pa.default_memory_pool()
    live = pa.array(np.arange(1_000_000, dtype=np.int64))
    freed = pa.array(np.arange(4_000_000, dtype=np.int64))
    del freed
    before = pool.bytes_allocated()
    ops.release_unused()
    assert pool.bytes_allocated() == before  # only memory nothing holds is handed back
    assert live.equals(pa.array(np.arange(1_000_000, dtype=np.int64)))
