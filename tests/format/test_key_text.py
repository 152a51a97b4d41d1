"""A trajectory key written as text (``str(key)``) and read back (``TrajectoryKey.parse``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlreplay.errors import KeyTextError, RlreplayError
from rlreplay.format.keys import INT64_MAX, INT64_MIN, TrajectoryKey

_VALUE = st.none() | st.integers(INT64_MIN, INT64_MAX) | st.text()
_KEY = st.builds(TrajectoryKey.of, _VALUE, _VALUE, _VALUE, st.booleans(), st.none() | st.text())


@given(_KEY)
def test_any_key_reads_back_from_its_text(key: TrajectoryKey) -> None:
    assert TrajectoryKey.parse(str(key)) == key


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "step=5,sample_index=12,rollout_n=0,validate=false,experiment=x",
            TrajectoryKey(5, 12, 0, False, "x"),
        ),
        ("sample=12, rollout=1", TrajectoryKey(None, 12, 1)),
        ("Step=-3,split=val,exp=run a", TrajectoryKey(-3, None, None, True, "run a")),
        ('step=1,sample_index="12"', TrajectoryKey(1, "12")),
        ('sample_index="a,b"', TrajectoryKey(None, "a,b")),
        ("sample_index=auto-0", TrajectoryKey(None, "auto-0")),
        ("experiment=12", TrajectoryKey(experiment="12")),
    ],
)
def test_parse_reads_the_selector_form(text: str, expected: TrajectoryKey) -> None:
    assert TrajectoryKey.parse(text) == expected


def test_text_that_is_not_a_number_is_written_quoted() -> None:
    assert str(TrajectoryKey(1, "12")) == 'step=1,sample_index="12",validate=false'
    assert str(TrajectoryKey(1, "a")) == "step=1,sample_index=a,validate=false"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("step=1,", "trailing comma"),
        ("step=1,,rollout_n=2", "empty item between commas"),
        ("step=1,step=2", "key 'step' given twice"),
        ("step=1,sample=2,sample_index=3", "key 'sample_index' given twice"),
        ("step=", "no value for 'step'"),
        ("colour=red", "unknown key 'colour'"),
        ("step", "'step' is not key=value"),
        ("", "no keys given"),
        ("validate=maybe", "validate='maybe' is not true or false"),
        ('step="1', "unfinished quoted value"),
        ('step="1" 2', "'2' after a quoted value"),
    ],
)
def test_parse_refuses_malformed_text_in_one_line(text: str, message: str) -> None:
    with pytest.raises(KeyTextError) as caught:
        TrajectoryKey.parse(text)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, RlreplayError)
