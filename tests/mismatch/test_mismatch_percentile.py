"""The |Δ| percentile of a step from pieces of it: each piece's count and largest values give
numpy's ``np.percentile`` of all the values, float for float, however the values are cut."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlreplay.mismatch import metrics as m

_values = hnp.arrays(
    np.float64,
    st.integers(1, 3000),
    elements=st.one_of(
        st.floats(0, 50, allow_nan=False, allow_infinity=False),
        st.sampled_from([0.0, 0.125, 1.5, 7.0]),  # ties, as float32 log-probs make them
    ),
)


@settings(max_examples=300, deadline=None)
@given(values=_values, cuts=st.lists(st.floats(0, 1), max_size=6), q=st.sampled_from([99, 50, 90, 1, 100]))
def test_percentile_of_the_largest_values_is_numpys(values, cuts: list[float], q: int) -> None:
    n = len(values)
    top = np.sort(values)[n - m.top_needed(n, q) :]
    assert m.percentile_of_top(n, top, q) == np.percentile(values, q)
    more = np.sort(values)[max(0, n - m.top_needed(n, q) - 5) :]  # more than read: the same
    assert m.percentile_of_top(n, more, q) == np.percentile(values, q)


@settings(max_examples=300, deadline=None)
@given(values=_values, cuts=st.lists(st.floats(0, 1), max_size=6), keep=st.integers(0, 40))
def test_tails_of_pieces_merge_into_the_percentile_of_all(values, cuts: list[float], keep: int) -> None:
    """Pieces cut at random points, each keeping ``keep`` (at least ``spare``) of its largest:
    merged, the p99 of all the values; or None, never another figure, when a piece kept too few,
    and then every piece keeping what the whole needs is always enough."""
    at = sorted({int(c * len(values)) for c in cuts})
    pieces = np.split(values, at)
    whole = np.percentile(values, m.GAP_PERCENTILE)
    assert m.Tail.of(values).percentile() == whole
    merged = m.Tail.merged([m.Tail.of(p, keep) for p in pieces])
    if merged is not None:
        assert merged.count == len(values) and merged.percentile() == whole
    need = m.top_needed(len(values))
    merged = m.Tail.merged([m.Tail.of(p, need) for p in pieces])
    assert merged is not None and merged.percentile() == whole


def test_a_piece_that_kept_too_few_is_told() -> None:
    """One piece of small values beside one of many large ones: the large piece's spare is not
    what the whole's percentile reads of it."""
    small, large = np.zeros(10_000), np.arange(1.0, 5_001.0)
    tails = [m.Tail.of(small, 0), m.Tail.of(large, 0)]
    assert not tails[1].whole and len(tails[1].values) == m.spare(5_000) < m.top_needed(15_000)
    assert m.Tail.merged(tails) is None
    again = [m.Tail.of(p, m.top_needed(15_000)) for p in (small, large)]
    assert m.Tail.merged(again).percentile() == np.percentile(np.r_[small, large], 99)


def test_how_many_the_percentile_reads() -> None:
    # (n - 1) * 0.99: its floor and the value above it, counted from the top
    assert [m.top_needed(n) for n in (0, 1, 2, 100, 101, 1000)] == [0, 1, 2, 2, 2, 11]
    assert all(m.top_needed(n) <= m.top_needed(n + 1) for n in range(1, 5000))
