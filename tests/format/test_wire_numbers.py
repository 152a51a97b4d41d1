"""Reading answers' JSON alike everywhere (``rlreplay.format.wire``): orjson reads integers beyond
64 bits as floats, so bytes that may hold one are read by Python's reader; a fraction's many digits
are no such integer (orjson and Python round them alike), so answers full of log-probs such as
``-0.0034284580033272505`` are read by orjson, and their values stay faithful."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rlreplay.format.wire import NOT_JSON, read_json, read_plain_json

DIGITS = st.text(alphabet="0123456789", min_size=1, max_size=40)


@settings(max_examples=500, deadline=None)
@given(
    whole=st.integers(min_value=-(10**18) + 1, max_value=10**18 - 1),
    fraction=DIGITS,
    exponent=st.one_of(st.none(), st.integers(min_value=-300, max_value=280)),  # finite
)
def test_a_fractions_many_digits_are_read_by_orjson_as_python_reads_them(
    whole: int, fraction: str, exponent: int | None
) -> None:
    number = f"{whole}.{fraction}" + ("" if exponent is None else f"e{exponent}")
    raw = f'{{"logprob":{number},"ids":[1,2]}}'.encode()
    value = read_plain_json(raw)
    assert value is not NOT_JSON
    assert value == json.loads(raw)


@settings(max_examples=500, deadline=None)
@given(
    big=st.one_of(
        st.integers(min_value=2**64, max_value=2**200),
        st.integers(min_value=-(2**200), max_value=-(2**63) - 1),
    ),
    where=st.sampled_from(['{"seed":%s}', "[1,%s]", "[%s]", '{"a":[0.5,%s]}', "%s", '{"x":1.5,"y":%s}']),
)
def test_an_integer_beyond_64_bits_is_read_exactly_wherever_it_is(big: int, where: str) -> None:
    raw = (where % big).encode()
    assert read_plain_json(raw) is NOT_JSON  # orjson would read a float
    assert read_json(raw) == json.loads(raw)
    assert str(big) in json.dumps(read_json(raw))  # the integer itself, not a float near it
