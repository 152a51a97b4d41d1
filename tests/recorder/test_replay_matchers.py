"""The replay's matchers on their own: a call's inputs match a recorded op's only when they hold the
same JSON values bit for bit (``-0.0`` is not ``0.0``; ``1``, ``1.0`` and ``true`` differ)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from rlreplay.recorder.matchers import Call, RecordedOp, inputs

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
#: values == calls equal and JSON writes apart
LOOK_ALIKE = [0.0, -0.0, 0, False, 1, 1.0, True]


def swapped(value: Any, choice: int) -> Any:
    """``value`` with each leaf that == 0 or 1 replaced by a look-alike (by ``choice``)."""
    if isinstance(value, dict):
        return {k: swapped(v, choice) for k, v in value.items()}
    if isinstance(value, list):
        return [swapped(v, choice + i) for i, v in enumerate(value)]
    if not isinstance(value, str) and value in (0, 1):
        alike = [x for x in LOOK_ALIKE if x == value]
        return alike[choice % len(alike)]
    return value


def written(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def served(recorded: Any, given_inputs: Any) -> bool:
    op = RecordedOp("s1", "generate", recorded, None)
    return inputs(op, Call("llm", "generate", given_inputs, 0)) is None


@given(JSON, st.integers(min_value=0, max_value=6))
def test_inputs_match_only_what_json_writes_the_same(value: Any, choice: int) -> None:
    other = swapped(value, choice)
    assert served(value, other) == (written(value) == written(other))
    assert served(value, value)


def test_a_negative_zero_or_a_bool_is_not_served_for_a_zero_or_an_int() -> None:
    recorded = {"sampling": {"temperature": -0.0, "seed": 1}, "prompt_ids": [0, 5, 7]}
    assert served(recorded, {"sampling": {"temperature": -0.0, "seed": 1}, "prompt_ids": [0, 5, 7]})
    op = RecordedOp("s1", "generate", recorded, None)
    reason = inputs(op, Call("llm", "generate", {**recorded, "sampling": {"temperature": 0.0, "seed": 1}}, 0))
    assert reason is not None and "sampling.temperature" in reason
    reason = inputs(op, Call("llm", "generate", {**recorded, "prompt_ids": [False, 5, 7]}, 0))
    assert reason is not None and "prompt_ids[0]" in reason
