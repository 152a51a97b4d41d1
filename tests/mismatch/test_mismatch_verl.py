"""``rlreplay mismatch`` per step against verl 0.9.1 itself: on the shipped showcase run (bfloat16
rollout, float32 trainer) and on a run recorded here with large planted gaps, every metric verl
defines equals what ``verl.trainer.ppo.rollout_corr_helper`` computes on the same batch, built from
the span files without rlreplay's readers (``tests/mismatch_truth.py``); the numbers verl does not
compute equal numpy's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mismatch_runs import record_planted
from mismatch_truth import padded, responses
from support import json_rows

ROOT = Path(__file__).resolve().parents[2]
SHOWCASE = ROOT / "sample_runs" / "verl-arith-smollm2"


def mismatch_json(*args: str) -> list[dict[str, Any]]:
    return json_rows("mismatch", *args, "--json", cwd=ROOT, timeout=600)


#: verl takes the sequence-level fraction as a float32 mean (``.float().mean()``): equal to float32's
#: precision; every other number is float64 through and through.
FLOAT32_IN_VERL = {"tis_seq_frac_high"}


def close(got: Any, want: float, name: str = "") -> bool:
    rel = 1e-6 if name in FLOAT32_IN_VERL else 1e-9
    return got is not None and math.isclose(got, want, rel_tol=rel, abs_tol=1e-12)


def verl_metrics(batch: list[dict[str, Any]]) -> dict[str, float]:
    """verl's own numbers for a batch: every one compute_offpolicy_metrics returns, by its name,
    and the IS weights' metrics of token-level TIS (cap 2), token-level IcePop ([0.5, 5]) and
    sequence-level TIS by the names rlreplay gives them."""
    from verl.trainer.ppo.rollout_corr_helper import (
        compute_offpolicy_metrics,
        compute_rollout_correction_weights,
    )

    old, roll, mask = padded(batch)
    out = dict(compute_offpolicy_metrics(old, roll, mask))
    log_ratio = old - roll
    _, tis = compute_rollout_correction_weights(log_ratio, mask, "token", 2.0)
    _, seq = compute_rollout_correction_weights(log_ratio, mask, "sequence", 2.0)
    try:
        _, icepop = compute_rollout_correction_weights(log_ratio, mask, "token", "0.5_5")
        out["icepop_token_frac_out"] = icepop["rollout_is_oob_ratio"]
    except ZeroDivisionError:  # IcePop zeroed every weight (verl's ESS of them divides by 0): all out
        counted = float(mask.sum())
        out["icepop_token_frac_out"] = counted / (counted + 1e-8)
    out["tis_token_frac_high"] = tis["rollout_is_ratio_fraction_high"]
    out["eff_sample_size"] = tis["rollout_is_eff_sample_size"]
    out["tis_seq_frac_high"] = seq["rollout_is_ratio_fraction_high"]
    return out


def numpy_metrics(batch: list[dict[str, Any]]) -> dict[str, float]:
    """What verl does not compute, by numpy over the counted tokens (mask 1, both log-probs)."""
    gaps, largest, seq_log_ratio = [], [], []
    for r in batch:
        n = len(r["ids"])
        counted = r["mask"][:n] & np.isfinite(r["rollout"][:n]) & np.isfinite(r["trainer"][:n])
        gap = np.abs(r["trainer"][:n] - r["rollout"][:n])[counted]
        gaps.append(gap)
        if len(gap):
            largest.append(gap.max())
        seq_log_ratio.append(float((r["trainer"][:n] - r["rollout"][:n])[counted].sum()))
    every = np.concatenate(gaps)
    ratio = np.array(seq_log_ratio)
    return {
        "tokens": len(every),
        "sequences": len(batch),
        "logprob_diff_mean": every.mean(),
        "logprob_diff_p99": np.percentile(every, 99),
        "logprob_diff_max": every.max(),
        "seq_logprob_diff_max_p50": np.percentile(largest, 50),
        "seq_logprob_diff_max_p90": np.percentile(largest, 90),
        "seq_logprob_diff_max_p99": np.percentile(largest, 99),
        "token_mult_prob_error": np.exp(every).mean(),
        "icepop_seq_frac_out": np.mean((ratio < math.log(0.5)) | (ratio > math.log(5))),
    }


def check_steps(run_dir: Path, rows: list[dict[str, Any]]) -> int:
    """Every training step's row against verl and numpy; returns the steps checked."""
    truth = responses(run_dir)
    steps = sorted({r["step"] for r in truth.values() if not r["validate"] and r["trainer"] is not None})
    by_step = {(r["step"], r["validate"]): r for r in rows}
    for step in steps:
        batch = [
            r for r in truth.values() if r["step"] == step and not r["validate"] and r["trainer"] is not None
        ]
        got = by_step[(step, False)]
        want = {**verl_metrics(batch), **numpy_metrics(batch)}
        for name in want:  # every number verl computes, by its name
            assert close(got[name], float(want[name]), name), (step, name, got[name], want[name])
        mult = want["token_mult_prob_error"]
        assert got["verdict"] == ("broken" if mult > 2 else "investigate" if mult > 1.05 else "healthy")
    return len(steps)


def test_the_showcase_runs_numbers_are_verls(tmp_path: Path) -> None:
    rows = mismatch_json(str(SHOWCASE))
    assert check_steps(SHOWCASE, rows) >= 2
    # the validation split has no trainer log-probs: no row for it, nothing invented
    assert {r["validate"] for r in rows} == {False}


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_planted(tmp_path_factory.mktemp("planted") / "run")


def test_a_run_with_large_gaps_gets_verls_numbers(planted: Path) -> None:
    rows = mismatch_json(str(planted))
    assert check_steps(planted, rows) == 4
    # the planted gaps put ratios beyond both bounds and spoil some steps: nothing here is 0 by luck
    assert all(r["tis_token_frac_high"] > 0 and r["icepop_token_frac_out"] > 0 for r in rows)
    assert {r["verdict"] for r in rows} >= {"healthy", "broken"}
