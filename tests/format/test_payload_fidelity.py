"""The payload codec gives back what was recorded, bit for bit, or says what it did not keep.

A value goes the way a span's output goes: ``to_payload`` (with its type record), token arrays
into typed columns (``Arrays``), JSON text, read back (``Restorer``), ``from_json``. Expected values
are the values themselves, compared by the bits of their floats and the types of everything; the
JSON form is compared with :func:`reference_form`, the documented convention written out here.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import numpy as np
import orjson
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlreplay.format import arrays, payload

MARKER_NAMES = ["tokens", "exception", "float", "int", "bytes", "set", "error", "truncated", "repr", "dict"]


def bits(value: Any) -> Any:
    """``value`` with floats as their IEEE-754 bits and every container tagged with its type, so
    that == is bit- and type-exact (NaN == NaN of the same bits; -0.0 != 0.0; (1,) != [1])."""
    cls = type(value)
    if cls is float:
        return ("f64", struct.pack("<d", value))
    if cls in (list, tuple):
        return (cls.__name__, [bits(v) for v in value])
    if cls is dict:
        return ("dict", [(bits(k), bits(v)) for k, v in value.items()])
    if cls in (set, frozenset):
        return (cls.__name__, sorted(repr(bits(v)) for v in value))
    return (cls.__name__, value)


def reference_form(value: Any) -> Any:
    """The JSON form README documents: markers for what JSON cannot hold, an op's own dict with a
    ``__type__`` key wrapped, tuples as lists, sets as their items (in some order)."""
    cls = type(value)
    if cls is float:
        if math.isfinite(value):
            return value
        marker = {"__type__": "float", "value": repr(value)}
        raw = struct.unpack("<Q", struct.pack("<d", value))[0]
        if value != value and raw != 0x7FF8000000000000:
            marker["bits"] = f"{raw:016x}"
        return marker
    if cls is int:
        if -(2**63) <= value < 2**64:
            return value
        return {"__type__": "int", "value": str(value) if value.bit_length() <= 13000 else hex(value)}
    if cls in (bytes, bytearray):
        return {"__type__": "bytes", "base64": base64.b64encode(value).decode()}
    if cls in (list, tuple):
        return [reference_form(v) for v in value]
    if cls is dict:
        inner = {k: reference_form(v) for k, v in value.items()}
        return {"__type__": "dict", "value": inner} if "__type__" in value else inner
    if cls in (set, frozenset):
        return {"__type__": "set", "items": [reference_form(v) for v in value]}
    return value


def json_text(form: Any) -> bytes:
    """Canonical text of a JSON form: keys sorted, a set marker's items in one order."""

    def canonical(value: Any) -> Any:
        if isinstance(value, list):
            return [canonical(v) for v in value]
        if isinstance(value, dict):
            out = {k: canonical(v) for k, v in value.items()}
            if out.get("__type__") == "set" and isinstance(out.get("items"), list):
                out["items"] = sorted(
                    out["items"], key=lambda v: orjson.dumps(v, option=orjson.OPT_SORT_KEYS)
                )
            return out
        return value

    return orjson.dumps(canonical(form), option=orjson.OPT_SORT_KEYS)


def through_the_format(value: Any) -> tuple[Any, dict[str, str]]:
    """``value`` as a span's output is written and read back: (its JSON form, its type record)."""
    types: dict[str, str] = {}
    form, _ = payload.to_payload(value, types=types)
    stored = arrays.Arrays()
    text = payload.dumps(stored.extract(form))
    columns = dict(zip(("token_ids", "token_masks", "token_logprobs"), stored.columns()))
    read = arrays.Restorer(lambda span, dtype: None).restore(orjson.loads(text), columns)
    return orjson.loads(orjson.dumps(read)), orjson.loads(orjson.dumps(types))


# -- values -------------------------------------------------------------------------------------

KEYS = st.text(alphabet="abcdefgh_0123456789", max_size=6) | st.just("__type__")
FLOATS = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True) | st.sampled_from(
    [
        -0.0,
        5e-324,
        -5e-324,
        2.2250738585072009e-308,
        float("nan"),
        -float("nan"),
        struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0],  # a signalling NaN
        struct.unpack("<d", struct.pack("<Q", 0xFFF8DEADBEEF0001))[0],  # a negative NaN with a payload
    ]
)
# 2**13001 and -(3**8300) are written in hex (beyond what Python converts to decimal freely)
INTS = st.integers() | st.sampled_from(
    [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 2**13001, -(3**8300)]
)
TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)
SCALARS = (
    st.none()
    | st.booleans()
    | INTS
    | FLOATS
    | TEXT
    | st.binary(max_size=12)
    | st.binary(max_size=4).map(bytearray)
)
HASHABLE = st.integers(-5, 5) | st.text(alphabet="xyz", max_size=3)


def marker_shaped(children: st.SearchStrategy) -> st.SearchStrategy:
    """An op's own dict shaped like one of the format's markers (or any dict with ``__type__``)."""
    return st.builds(
        lambda kind, rest: {"__type__": kind, **rest},
        st.sampled_from(MARKER_NAMES) | TEXT,
        st.dictionaries(
            st.sampled_from(["t", "o", "n", "s", "r", "value", "items", "type", "message"]), children
        ),
    )


VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=5)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(KEYS, children, max_size=5)
        | marker_shaped(children)
        | st.sets(HASHABLE, max_size=4)
        | st.frozensets(HASHABLE, max_size=3)
        | st.lists(st.integers(-(2**31), 2**31 - 1), min_size=64, max_size=80)  # a typed id column
        | st.lists(st.floats(width=32), min_size=64, max_size=70)  # a typed log-prob column
        | st.lists(st.integers(0, 1), min_size=64, max_size=70).map(lambda m: {"response_mask": m})
    ),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(VALUES)
def test_a_value_comes_back_bit_for_bit_and_its_json_form_is_unambiguous(value: Any) -> None:
    form, types = through_the_format(value)
    assert json_text(form) == json_text(orjson.loads(orjson.dumps(reference_form(value))))
    assert bits(payload.from_json(form, types)) == bits(value)
    assert types[""] == f"builtins.{type(value).__name__}"


@settings(max_examples=200, deadline=None)
@given(marker_shaped(SCALARS | st.lists(st.integers(0, 2**31 - 1), min_size=64, max_size=66)))
def test_data_shaped_like_a_marker_is_never_read_as_one(value: dict) -> None:
    """The restorer (token placeholders), readers and the decoder see the op's dict as data."""
    form, types = through_the_format({"out": value, "again": [value]})
    assert form["out"]["__type__"] == "dict" and form["out"]["value"]["__type__"] == value["__type__"]
    assert json_text(form["out"]) == json_text(orjson.loads(orjson.dumps(reference_form(value))))
    assert bits(payload.from_json(form, types)) == bits({"out": value, "again": [value]})


class Reply(pydantic.BaseModel):
    token_ids: list[int]


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"x": Opaque()}, f"a {__name__}.Opaque at /x was recorded as its repr"),
        ({"a": [np.float32(0.5)]}, "a numpy.float32 at /a/0 was recorded as a number, and is not rebuilt"),
        (np.arange(3), "a numpy.ndarray at the output was recorded as a list, and is not rebuilt"),
        (
            Reply(token_ids=[1]),
            f"a {__name__}.Reply at the output was recorded as an object, and is not rebuilt",
        ),
        ({1: "one"}, "a dict whose keys were not all strings (recorded as strings) at the output"),
        ({"k": {(1, 2): "pair"}}, "a dict whose keys were not all strings (recorded as strings) at /k"),
        ({"api_key": "s3cr3t-value"}, "a value hidden by redaction at /api_key"),
        (["https://bob:hunter22@example.com/x"], "a value hidden by redaction at /0"),
        ({"t": "bad \udcff text"}, "a string that was not valid Unicode (recorded escaped) at /t"),
    ],
)
def test_what_is_not_kept_is_named_with_where(value: Any, why: str) -> None:
    form, types = through_the_format(value)
    with pytest.raises(payload.NotExact) as caught:
        payload.from_json(form, types)
    assert str(caught.value) == why


def test_a_truncated_field_a_cycle_and_a_failed_value_are_not_kept() -> None:
    types: dict[str, str] = {}
    cyclic: list = [1]
    cyclic.append(cyclic)
    form, _ = payload.to_payload({"big": "x" * 5000, "loop": cyclic}, types=types)
    text = payload.dumps(form, max_field_bytes=1000)
    read = orjson.loads(text)
    with pytest.raises(payload.NotExact, match="a value at /big was recorded truncated"):
        payload.from_json(read, types)
    with pytest.raises(payload.NotExact, match=r"a builtins\.list at /loop/1 holds itself"):
        payload.from_json({"loop": read["loop"]}, types)
    with pytest.raises(payload.NotExact, match=r"a value at /x could not be recorded \(boom\)"):
        payload.from_json({"x": {"__type__": "error", "error": "boom"}}, {"": "builtins.dict"})


def test_an_adapters_builders_rebuild_its_own_types_only() -> None:
    value = (Reply(token_ids=[1, 2]), 0.5, {"ok": True})
    form, types = through_the_format(value)
    assert types == {
        "": "builtins.tuple",
        "/0": f"{__name__}.Reply",
    }
    built = payload.from_json(form, types, {types["/0"]: Reply.model_validate})
    assert type(built) is tuple and built == value and type(built[0]) is Reply
    with pytest.raises(payload.NotExact, match="Reply at /0"):
        payload.from_json(form, types)


def test_ints_beyond_the_decimal_conversion_limit() -> None:
    value = {"n": 7**20000, "m": [-(7**20000)]}  # 16,900 digits: str() refuses them
    form, types = through_the_format(value)
    assert form["n"] == {"__type__": "int", "value": hex(7**20000)}
    assert payload.from_json(form, types) == value


def test_outputs_recorded_before_type_records_read_as_their_json_values() -> None:
    """Spans written before outputs had a type record: markers decoded, JSON values as they are;
    big ints as rlreplay recorded them then (a ``repr`` marker of an int) too."""
    old = {
        "n": {"__type__": "float", "value": "nan"},
        "big": {"__type__": "repr", "class": "builtins.int", "repr": str(2**80)},
        "pair": [1, 2],
    }
    back = payload.from_json(old)
    assert math.isnan(back["n"]) and back["big"] == 2**80 and back["pair"] == [1, 2]


_BASE64_LIKE = st.one_of(
    st.text(),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \n"),
    st.binary().map(lambda raw: base64.b64encode(raw).decode()),
    st.binary().map(lambda raw: base64.b64encode(raw).decode()[:-1]),
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(_BASE64_LIKE)
def test_a_bytes_marker_reads_as_standard_base64_says(text: str) -> None:
    """Kept bytes are read back as the standard library's validating base64 decoding reads their
    text, never as other bytes; what base64 writes is always read; anything else may be refused
    (``NotExact``; readers then show no text)."""
    marker = {"__type__": "bytes", "base64": text}
    try:
        standard: bytes | None = base64.b64decode(text, validate=True)
    except ValueError:
        standard = None
    try:
        read: bytes | None = payload.from_json(marker)
    except payload.NotExact:
        read = None
    if read is not None:
        assert read == standard
    if standard is not None and base64.b64encode(standard).decode() == text:
        assert read == standard
    try:
        shown = None if read is None else f"({len(read):,} bytes, UTF-8) {read.decode('utf-8')}"
    except UnicodeDecodeError:
        shown = None
    assert payload.kept_text(marker) == shown
