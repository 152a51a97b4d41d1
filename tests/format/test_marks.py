"""The cheap test of which marks some bytes hold: one pass that finds what a search for each finds."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from rlreplay.format.marks import any_finder, held, holds_any

MARKS = ("tool_calls", "calls", "ls_c", '"calls"', "token", "secret", "secretoken", "é")
PIECES = st.sampled_from(
    [*MARKS, *{m[:2] for m in MARKS}, *{m[-2:] for m in MARKS}, "x", " ", "\\u00", "\u4e00"]
)
TEXTS = st.builds("".join, st.lists(PIECES, max_size=30))


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_the_marks_held_are_those_a_search_for_each_finds(text: str) -> None:
    data = text.encode()
    assert held(data, MARKS) == {m for m in MARKS if m in text}
    assert any_finder(MARKS)(data) == any(m in text for m in MARKS)


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(st.one_of(st.none(), TEXTS), max_size=8),
    cut=st.integers(0, 8),
    kind=st.sampled_from([pa.string(), pa.large_string(), pa.binary(), pa.large_binary()]),
    offset=st.integers(0, 3),
)
def test_each_string_of_an_arrow_column_is_tested_on_its_own(
    texts: list[str | None], cut: int, kind: pa.DataType, offset: int
) -> None:
    """Chunked or sliced, nulls anywhere: a mark is found in a string only when it holds one (two
    neighbours that spell one between them do not)."""
    values = [
        None
        if t is None
        else (t.encode() if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) else t)
        for t in texts
    ]
    whole = pa.array(["x"] * offset + values, kind).slice(offset)
    column = pa.chunked_array([whole[:cut], whole[cut:]], kind)
    expected = [t is not None and any(m in t for m in MARKS) for t in texts]
    assert holds_any(column, MARKS).tolist() == expected
    assert holds_any(whole, MARKS).tolist() == expected
