"""``rlreplay mismatch`` on runs without the trainer's per-token log-probs: the per-rollout figures
the trainer recorded (the listing's ``logprob_diff_mean``, ``logprob_diff_max``,
``importance_ratio``), labelled per rollout, computed here from the span files with pyarrow; the
same definitions as the per-token figures of the same name; and every shipped run answers."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from mismatch_truth import span_rows
from test_mismatch_cli import rlreplay
from test_mismatch_verl import ROOT, SHOWCASE, mismatch_json

PER_ROLLOUT = ROOT / "sample_runs" / "verl-toolagent-smollm2"  # recorded without --token-signals
SHIPPED = sorted(p for p in (ROOT / "sample_runs").iterdir() if (p / "run.json").exists())


def listing_truth(run: Path) -> dict[tuple[int, bool], dict[str, float]]:
    """Per step and split, the per-rollout figures from the signals spans (pyarrow alone)."""
    figures: dict[tuple[int, bool], list[tuple[float, float, float]]] = defaultdict(list)
    for row in span_rows(run):
        if row["kind"] != "signals" or row["logprob_diff_max"] is None:
            continue
        figures[(row["step"], bool(row["validate"]))].append(
            (row["logprob_diff_mean"], row["logprob_diff_max"], row["importance_ratio"])
        )
    out = {}
    for key, rows in figures.items():
        mean, largest, ratio = (np.array(c, dtype=np.float64) for c in zip(*rows))
        log_ratio = np.log(ratio)
        out[key] = {
            "sequences": len(rows),
            "seq_logprob_diff_mean": float(mean.mean()),
            "logprob_diff_max": float(largest.max()),
            "seq_logprob_diff_max_p50": float(np.percentile(largest, 50)),
            "seq_logprob_diff_max_p90": float(np.percentile(largest, 90)),
            "seq_logprob_diff_max_p99": float(np.percentile(largest, 99)),
            "chi2_seq": float(np.mean(np.exp(2 * np.clip(log_ratio, -20, 20))) - 1),
            "tis_seq_frac_high": float(np.mean(ratio > 2)),
            "icepop_seq_frac_out": float(np.mean((ratio < 0.5) | (ratio > 5))),
        }
    return out


@pytest.mark.parametrize("run", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_run_answers(run: Path) -> None:
    proc = rlreplay(str(run))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout
    if run != SHOWCASE:  # no per-token trainer log-probs: one short line on how to get them
        lines = [line for line in proc.stdout.splitlines() if "--token-signals" in line]
        assert len(lines) == 1 and len(lines[0]) <= 120, proc.stdout


def test_per_rollout_figures_are_the_trainers_and_say_so() -> None:
    rows = mismatch_json(str(PER_ROLLOUT))
    truth = listing_truth(PER_ROLLOUT)
    assert {(r["step"], r["validate"]) for r in rows} == set(truth)
    for row in rows:
        want = truth[(row["step"], row["validate"])]
        assert row["per"] == "rollout" and row["tokens"] is None and row["verdict"] is None
        for name, value in want.items():
            assert row[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
        # the per-token figures are not made up from per-rollout ones
        for name in ("logprob_diff_mean", "kl", "k3_kl", "chi2_token", "token_mult_prob_error"):
            assert row[name] is None, name
    text = rlreplay(str(PER_ROLLOUT)).stdout
    assert "per rollout" in text and "not per token" in text
    assert "rlreplay record --token-signals" in text
    step = rows[0]
    line = next(x for x in text.splitlines() if x.split()[:2] == [str(step["step"]), "train"])
    assert f"{step['logprob_diff_max']:.4g}" in line.split()


def test_per_rollout_worst_rollouts_are_the_listings(tmp_path: Path) -> None:
    proc = rlreplay(str(PER_ROLLOUT))
    worst = proc.stdout.split("worst rollouts")[1].splitlines()[2]
    signals = [
        r for r in span_rows(PER_ROLLOUT) if r["kind"] == "signals" and r["logprob_diff_max"] is not None
    ]
    top = max(signals, key=lambda r: r["logprob_diff_max"])
    assert worst.split()[0] == top["trajectory_id"][:12]
    assert f"{top['logprob_diff_max']:.4g}" in worst.split()


def test_per_rollout_figures_have_the_per_token_definitions() -> None:
    """On the showcase (both recorded), the figures computed from the listing equal those computed
    from the tokens: one definition of each (up to the trainer's float32 arithmetic)."""
    from rlreplay.mismatch import metrics as m
    from rlreplay.mismatch.report import compute, per_rollout
    from rlreplay.read.open import open_run

    run = open_run(SHOWCASE)
    listing = run.trajectories()
    listing = listing.filter(pc.invert(listing["validate"]))
    tokens = {r["step"]: r for r in compute(run, listing, token_ids=False).steps}
    rollouts = {r["step"]: r for r in per_rollout(listing).steps}
    assert set(tokens) == set(rollouts) and len(tokens) == 6
    for step, row in rollouts.items():
        assert row["sequences"] == tokens[step]["sequences"]
        for name in m.ROLLOUT_METRICS:
            assert math.isclose(row[name], tokens[step][name], rel_tol=1e-4, abs_tol=1e-6), (step, name)


def test_a_selection_without_any_trainer_figure_says_so_in_one_line() -> None:
    proc = rlreplay(str(SHOWCASE), "--validate")  # verl computes no trainer log-probs there
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "nothing to compare" in proc.stdout and "--token-signals" in proc.stdout
    assert len(proc.stdout.splitlines()) <= 3
    proc = rlreplay(str(SHOWCASE), "--validate", "--json")
    assert proc.returncode == 0 and proc.stdout == "" and "nothing to compare" in proc.stderr
