"""The trend of the gap over training steps: rising (vime #64's SGLang gap, 0.011 to 0.036), a spike
(a refit or a kernel bug), flat, falling, and too few steps to tell."""

from __future__ import annotations

import numpy as np
import pytest

from rlreplay.mismatch.metrics import trend


def noisy(level: float, n: int, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [level * (1 + 0.05 * rng.standard_normal()) for _ in range(n)]


@pytest.mark.parametrize(
    ("values", "shape", "spikes"),
    [
        (list(np.linspace(0.011, 0.036, 12)), "rising", []),
        (noisy(0.012, 12), "flat", []),
        (list(np.linspace(0.05, 0.01, 9)), "falling", []),
        ([*noisy(0.01, 5), 0.4, *noisy(0.01, 6, seed=1)], "spiky", [5]),
        ([0.01, 0.02], None, []),
    ],
    ids=["rising", "flat", "falling", "spiky", "too-few"],
)
def test_the_shape_of_the_gap_over_steps(values: list[float], shape: str | None, spikes: list[int]) -> None:
    steps = list(range(len(values)))
    found = trend("logprob_diff_mean", steps, values)
    assert found.shape == shape and found.spikes == spikes
    if shape in ("rising", "falling", "flat"):  # the ends compared: the first and last thirds' means
        k = len(values) // 3
        assert found.first == pytest.approx(np.mean(values[:k])) and found.last == pytest.approx(
            np.mean(values[-k:])
        )
    if shape == "rising":
        assert "engine or weight drift" in found.text
    if shape == "spiky":
        assert "spiky at step 5" in found.text


def test_a_step_without_tokens_is_no_point_of_the_trend() -> None:
    found = trend("logprob_diff_mean", [1, 2, 3, 4], [0.01, None, 0.011, 0.0105])
    assert found.shape == "flat" and found.steps == [1, 2, 3, 4]
