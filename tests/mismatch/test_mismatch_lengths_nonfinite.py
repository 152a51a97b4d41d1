"""Responses whose trainer log-probs are not one per response token are left out and counted,
never cut or padded; model tokens whose log-probs (or their difference) are NaN or ±inf are left
out and counted, never a traceback and never a NaN among the figures. The counts are in ``--json``
(per step and split) and in the text report."""

from __future__ import annotations

import asyncio
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import rlreplay_proc

import rlreplay
from rlreplay.mismatch import metrics as m
from rlreplay.mismatch.tokens import Batch, counted_tokens, part
from rlreplay.recorder.signals import record_signals

INF = math.inf
NAN = math.nan


def _responses() -> list[dict]:
    """(step, n, trainer length, rollout edits, trainer edits) of each recorded response."""
    return [
        {"step": 0, "n": 10, "trainer_n": 10},
        {"step": 0, "n": 11, "trainer_n": 11},
        {"step": 0, "n": 12, "trainer_n": 9},  # shorter: verl would have cut nothing, we cut nothing
        {"step": 0, "n": 9, "trainer_n": 11},  # longer
        {"step": 0, "n": 80, "trainer_n": 79},  # a typed column, one short
        {"step": 1, "n": 10, "trainer_n": 10, "trainer": {2: NAN, 3: INF}, "rollout": {4: -INF}},
        {"step": 1, "n": 10, "trainer_n": 10, "trainer": {1: 1e308}, "rollout": {1: -1e308}},
        {"step": 1, "n": 10, "trainer_n": 10, "trainer": dict.fromkeys(range(10), -INF)},
        {"step": 1, "n": 12, "trainer_n": 12, "trainer": {5: 700.0}, "rollout": {5: -100.0}},
        {"step": 2, "n": 10, "trainer_n": 4},  # a step of which nothing can be compared
    ]


def _record(run_dir: Path) -> list[dict]:
    rng = np.random.default_rng(3)

    @rlreplay.trace_op(name="AgentLoop.run", kind="agent")
    async def agent(ids: list[int], rollout: list[float]) -> dict:
        return {"response_ids": ids, "response_mask": [1] * len(ids), "response_logprobs": rollout}

    async def one(sample: int, spec: dict) -> None:
        n = spec["n"]
        rollout = [float(v) for v in np.float32(-rng.random(n) * 3)]
        k = min(n, spec["trainer_n"])
        trainer = [float(v) for v in np.float32(np.array(rollout[:k]) + rng.normal(0, 0.05, k))]
        trainer += [-0.5] * (spec["trainer_n"] - len(trainer))
        for at, value in spec.get("rollout", {}).items():
            rollout[at] = value
        for at, value in spec.get("trainer", {}).items():
            trainer[at] = value
        async with rlreplay.trajectory(step=spec["step"], sample_index=sample, rollout_n=0) as traj:
            await agent(list(range(100, 100 + n)), rollout)
        record_signals(
            traj.id,
            step=spec["step"],
            sample_index=sample,
            rollout_n=0,
            validate=False,
            output={"old_log_probs": trainer},
        )
        spec.update(rollout_values=rollout, trainer_values=trainer)

    specs = _responses()
    rlreplay.init(run_dir, worker="w0")
    for sample, spec in enumerate(specs):
        asyncio.run(one(sample, spec))
    rlreplay.close()
    return specs


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("lengths") / "run"
    return run_dir, _record(run_dir)


def _truth(specs: list[dict]) -> dict[int, dict]:
    """Per step, from what the test recorded: responses compared and left out, counted gaps."""
    out: dict[int, dict] = {}
    for spec in specs:
        row = out.setdefault(spec["step"], {"sequences": 0, "lengths_differ": 0, "gaps": [], "not_finite": 0})
        if spec["n"] != spec["trainer_n"]:
            row["lengths_differ"] += 1
            continue
        row["sequences"] += 1
        for r, t in zip(spec["rollout_values"], spec["trainer_values"]):
            gap = abs(t - r) if math.isfinite(r) and math.isfinite(t) else INF
            if math.isfinite(gap):
                row["gaps"].append(gap)
            else:
                row["not_finite"] += 1
    return out


def test_lengths_that_differ_and_non_finite_tokens_are_left_out_and_counted(
    run: tuple[Path, list[dict]],
) -> None:
    run_dir, specs = run
    proc = rlreplay_proc("mismatch", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    rows = {r["step"]: r for r in map(json.loads, proc.stdout.splitlines())}
    truth = _truth(specs)
    assert set(rows) == set(truth)
    for step, want in truth.items():
        row = rows[step]
        assert row["sequences"] == want["sequences"], step
        assert row["lengths_differ"] == want["lengths_differ"], step
        assert row["tokens"] == len(want["gaps"]) and row["tokens_not_finite"] == want["not_finite"], step
        if want["gaps"]:
            assert row["logprob_diff_mean"] == pytest.approx(np.mean(want["gaps"]), rel=1e-12)
            assert row["logprob_diff_max"] == max(want["gaps"])
    assert rows[2]["tokens"] == 0 and rows[2]["verdict"] is None
    # exp(800) overflows: that figure is infinite, and --json says so as the format's float marker
    assert rows[1]["token_mult_prob_error"] == {"__type__": "float", "value": "inf"}
    assert "lengths differ" in proc.stderr and "not finite" in proc.stderr


def test_the_text_report_says_what_was_left_out(run: tuple[Path, list[dict]]) -> None:
    run_dir, specs = run
    proc = rlreplay_proc("mismatch", str(run_dir))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "Warning" not in proc.stderr, (
        proc.stderr
    )
    differ = sum(s["n"] != s["trainer_n"] for s in specs)
    assert f"{differ} of {len(specs)} selected trajectories" in proc.stdout
    assert "lengths differ" in proc.stdout and "never cut" in proc.stdout
    not_finite = sum(t["not_finite"] for t in _truth(specs).values())
    assert f"{not_finite} model tokens" in proc.stdout and "not finite" in proc.stdout


def test_the_audit_and_by_buckets_take_the_same_tokens(run: tuple[Path, list[dict]]) -> None:
    run_dir, specs = run
    proc = rlreplay_proc("audit", str(run_dir), "--checks", "mismatch")
    assert "Traceback" not in proc.stderr and "failed" not in proc.stdout + proc.stderr, proc.stderr
    proc = rlreplay_proc("mismatch", str(run_dir), "--json", "--by", "position")
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr
    counted = sum(len(t["gaps"]) for t in _truth(specs).values())
    assert sum(json.loads(line)["tokens"] for line in proc.stdout.splitlines()) == counted


# ---- the class: any mix of NaN, ±inf and huge values ---------------------------------------------

VALUE = st.one_of(
    st.floats(-30.0, 0.0),
    st.sampled_from([NAN, INF, -INF, 1e308, -1e308, 3.4e38, -3.4e38, 0.0]),
)


@st.composite
def batches(draw: st.DrawFn) -> list[dict]:
    out = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(0, 20))
        values = st.lists(VALUE, min_size=n, max_size=n)
        out.append(
            {
                "rollout": np.array(draw(values), dtype=np.float64),
                "trainer": np.array(draw(values), dtype=np.float64),
                "mask": np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool),
            }
        )
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_non_finite_log_probs_never_reach_a_figure(batch: list[dict]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or invalid-value warning either
        made = Batch.of(
            np.arange(len(batch)),
            np.zeros(len(batch), dtype=bool),
            [part(np.arange(len(r["mask"])), r["mask"], r["rollout"], r["trainer"]) for r in batch],
            [None] * len(batch),
        )
        sums = m.sequence_sums(made)
        got = m.summarize(m.totals_of(sums), sums)
    gaps = []
    for r in batch:
        with np.errstate(all="ignore"):
            gap = np.abs(r["trainer"] - r["rollout"])
        gaps.extend(gap[r["mask"] & np.isfinite(gap)].tolist())
    assert got["tokens"] == len(gaps) == int(counted_tokens(made.mask, made.rollout, made.trainer).sum())
    for name, value in got.items():
        assert value is None or not math.isnan(value), name
    if gaps:
        assert got["logprob_diff_max"] == max(gaps)
        assert got["logprob_diff_mean"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-9)
    else:
        assert got["logprob_diff_mean"] is None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(VALUE, VALUE, VALUE), min_size=0, max_size=12))
def test_per_rollout_figures_leave_out_what_is_not_finite(rows: list[tuple[float, float, float]]) -> None:
    mean, largest, ratio = (np.array(c, dtype=np.float64) for c in zip(*rows)) if rows else (np.zeros(0),) * 3
    ratio = np.abs(ratio)  # a ratio is ≥ 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = m.rollout_metrics(mean, largest, ratio)
    for name, value in got.items():  # a mean of finite figures past float64 is inf, never NaN
        assert value is None or not math.isnan(value), name
    assert got["sequences"] == int(
        np.sum(np.isfinite(mean) | np.isfinite(largest) | (np.isfinite(ratio) & (ratio > 0)))
    )
    finite = largest[np.isfinite(largest)]
    assert got["logprob_diff_max"] == (float(finite.max()) if len(finite) else None)
    known = ratio[np.isfinite(ratio) & (ratio > 0)]
    want = float(np.mean(known > 2)) if len(known) else None
    assert got["tis_seq_frac_high"] == want


def test_a_trend_and_its_sparkline_over_non_finite_values() -> None:
    from rlreplay.cli.app import sparkline

    values = [0.01, 0.02, INF, 0.01, NAN, 0.015, None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trend = m.trend("x", list(range(len(values))), values)
    assert trend.shape is not None and INF not in (trend.first, trend.last)
    line = sparkline(values)
    assert len(line) == len(values) and line[2] == " " and line[4] == " "


def test_counts_of_parts_of_a_selection_add_up() -> None:
    """What a selection read in parts left out adds up to what it left out read whole."""
    from rlreplay.mismatch.tokens import Counts

    a = Counts(selected=5, compared=3, no_trainer=1, lengths_differ=1, lengths_differ_at={(0, False): 1})
    a.lengths_example = "trainer log probs: 4 for 10 tokens"
    b = Counts(
        selected=4,
        compared=2,
        no_rollout=1,
        lengths_differ=2,
        lengths_differ_at={(0, False): 1, (1, True): 1},
    )
    b.issues.append("span x: unreadable")
    a.merge(b)
    assert (a.selected, a.compared, a.no_trainer, a.no_rollout, a.lengths_differ) == (9, 5, 1, 1, 3)
    assert a.lengths_differ_at == {(0, False): 2, (1, True): 1} and a.issues == ["span x: unreadable"]
    assert a.lengths_example == "trainer log probs: 4 for 10 tokens"
