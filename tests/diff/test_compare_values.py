"""How ``compare`` shows two differing values: the values at the first differing path, and short
excerpts of them that always tell the two apart (hypothesis over JSON values)."""

from __future__ import annotations

import orjson
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rlreplay.compare import SHOWN_CHARS, excerpts
from rlreplay.recorder.matchers import ABSENT, first_path, first_values

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=6),
    max_leaves=40,
)


def _stripped(excerpt: str) -> str:
    """An excerpt without the ``…`` marking where it was cut (JSON text never begins or ends with one)."""
    return excerpt.removeprefix("…").removesuffix("…")


def _json(value) -> bytes:
    """A JSON value's text, keys sorted: equal only for the same value (``0`` is not ``false``,
    ``1`` not ``1.0``, ``-0.0`` not ``0.0``), where Python's ``==`` says ``0 == False``."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


@settings(max_examples=300, deadline=None)
@given(json_values, json_values)
@example([0], [False, None])  # 0 and false differ at [0], though Python's 0 == False
def test_the_values_at_the_first_path_differ(a, b) -> None:
    if _json(a) == _json(b):
        return
    path, va, vb = first_values(a, b)
    assert path == first_path(a, b)
    assert va is ABSENT or vb is ABSENT or _json(va) != _json(vb)


@settings(max_examples=300, deadline=None)
@given(json_values, json_values, st.integers(min_value=8, max_value=120))
def test_excerpts_are_short_true_and_tell_the_values_apart(a, b, limit: int) -> None:
    full_a, full_b = orjson.dumps(a).decode(), orjson.dumps(b).decode()  # the JSON text shown
    if full_a == full_b:
        return
    shown_a, shown_b = excerpts(a, b, limit)
    assert shown_a != shown_b
    for shown in (shown_a, shown_b):
        assert shown is not None and len(shown) <= limit + 2
    # the excerpts are pieces of the values' JSON text, cut at the same place
    assert _stripped(shown_a) in full_a and _stripped(shown_b) in full_b
    assert shown_a.startswith("…") == shown_b.startswith("…")


def test_a_long_text_is_shown_where_it_changes() -> None:
    a = "x" * 500 + "the answer is 41" + "y" * 500
    b = "x" * 500 + "the answer is 42" + "y" * 500
    shown_a, shown_b = excerpts(a, b)
    assert "answer is 41" in shown_a and "answer is 42" in shown_b
    assert shown_a.startswith("…") and shown_a.endswith("…") and len(shown_a) == SHOWN_CHARS + 2


def test_a_side_without_a_value_is_none() -> None:
    path, va, vb = first_values({"calls": [1, 2]}, {"calls": [1]})
    assert (path, va, vb) == ("calls[1]", 2, ABSENT)
    assert excerpts(va, vb) == ("2", None)
    assert excerpts(ABSENT, "z" * 200)[1] == '"' + "z" * (SHOWN_CHARS - 2) + "…"


def test_an_int_beyond_64_bits_is_shown_whole() -> None:
    big = 2**64 + 1
    assert excerpts(big, big + 1) == (str(big), str(big + 1))
