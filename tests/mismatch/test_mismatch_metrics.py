"""The metric definitions against verl 0.9.1's own functions on random batches (hypothesis): any
lengths, masks, gaps up to far beyond verl's ±20 clamp, responses without a counted token, and
log-probs that are missing on a model token (never counted)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mismatch_truth import padded
from test_mismatch_verl import close, verl_metrics

from rlreplay.mismatch import metrics as m
from rlreplay.mismatch.tokens import Batch, part

LOGPROB = st.floats(-30.0, 0.0, allow_nan=False)
GAP = st.one_of(st.floats(-0.05, 0.05), st.floats(-40.0, 40.0))


@st.composite
def responses(draw: st.DrawFn) -> list[dict]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 30))
        rollout = np.array(draw(st.lists(LOGPROB, min_size=n, max_size=n)))
        trainer = rollout + np.array(draw(st.lists(GAP, min_size=n, max_size=n)))
        mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
        if n and draw(st.booleans()):  # a model token whose rollout log-prob was not recorded
            rollout[draw(st.integers(0, n - 1))] = np.nan
        out.append({"ids": np.arange(n), "rollout": rollout, "trainer": trainer, "mask": mask})
    return out


def summary(batch: list[dict], chunk: int = m.CHUNK_TOKENS) -> dict:
    made = Batch.of(
        np.arange(len(batch)),
        np.zeros(len(batch), dtype=bool),
        [part(r["ids"], r["mask"], r["rollout"], r["trainer"]) for r in batch],
        [None] * len(batch),
    )
    sums = m.sequence_sums(made, chunk=chunk)
    return m.summarize(m.totals_of(sums), sums)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses())
def test_every_verl_metric_is_verls(batch: list[dict]) -> None:
    counted = [r["mask"] & np.isfinite(r["rollout"]) for r in batch]
    if not any(c.any() for c in counted):
        return  # verl asserts there is a token to count
    for r, c in zip(batch, counted):
        r["verl_mask"] = c
    got = summary(batch)
    want = verl_metrics([{**r, "mask": r["verl_mask"]} for r in batch])
    for name, value in want.items():  # every number verl computes
        value = float(value)
        if math.isinf(value):
            assert got[name] == value, name
        else:
            assert close(got[name], value, name) or math.isclose(got[name], value, abs_tol=1e-9), (
                name,
                got[name],
                value,
            )
    # a step is reduced a few responses at a time: any cut gives the same numbers
    cut = summary(batch, chunk=7)
    for name, value in got.items():
        assert (cut[name] is None) if value is None else math.isclose(cut[name], value, rel_tol=1e-12), name
    gaps = np.concatenate([np.abs(r["trainer"] - r["rollout"])[c] for r, c in zip(batch, counted)])
    assert got["tokens"] == len(gaps) and got["sequences"] == len(batch)
    assert math.isclose(got["logprob_diff_mean"], gaps.mean(), rel_tol=1e-12)
    assert got["logprob_diff_max"] == gaps.max()


def test_padding_is_what_verl_sees() -> None:
    """The tests' padded batch: zeros past each response, its mask 0 there."""
    first = {"ids": [1, 2], "trainer": np.array([-1.0, -2.0]), "rollout": np.array([-1.5, np.nan])}
    second = {"ids": [1], "trainer": np.array([-3.0]), "rollout": np.array([-3.5])}
    old, roll, mask = padded(
        [{**first, "mask": np.array([True, False])}, {**second, "mask": np.array([True])}]
    )
    assert old.tolist() == [[-1.0, -2.0], [-3.0, 0.0]]
    assert roll.tolist() == [[-1.5, 0.0], [-3.5, 0.0]]
    assert mask.tolist() == [[1.0, 0.0], [1.0, 0.0]]
