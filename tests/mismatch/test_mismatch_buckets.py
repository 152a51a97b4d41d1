"""``rlreplay mismatch --by KEY``: every bucket's numbers equal numpy's over the same tokens, read
from the span files without rlreplay's readers; a bucket without data is said, never invented."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mismatch_runs import record_planted
from mismatch_truth import responses
from support import rlreplay_proc
from test_mismatch_verl import ROOT, SHOWCASE, mismatch_json

TOKEN_METRICS = (
    "tokens",
    "logprob_diff_mean",
    "logprob_diff_max",
    "token_mult_prob_error",
    "kl",
    "k3_kl",
    "chi2_token",
    "tis_token_frac_high",
    "icepop_token_frac_out",
    "eff_sample_size",
)
SEQUENCE_METRICS = (
    "sequences",
    "chi2_seq",
    "log_ppl_diff",
    "seq_logprob_diff_max_p50",
    "seq_logprob_diff_max_p90",
)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_planted(tmp_path_factory.mktemp("planted") / "run")


def position_label(p: int) -> str:
    if p < 16:
        return "0-15"
    lo = 1 << (p.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


ENTROPY = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


def entropy_label(e: float) -> str:
    k = max(i for i, edge in enumerate(ENTROPY) if e >= edge)
    return f"{ENTROPY[k]:g}+" if k == len(ENTROPY) - 1 else f"{ENTROPY[k]:g}-{ENTROPY[k + 1]:g}"


def tokens(truth: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every counted token of the training responses with its keys, one by one."""
    out = []
    for tid, r in truth.items():
        if r["validate"] or r["trainer"] is None:
            continue
        turn, before = 0, False
        for i in range(len(r["ids"])):
            model = bool(r["mask"][i])
            turn += model and not before
            before = model
            if not (model and math.isfinite(r["rollout"][i]) and math.isfinite(r["trainer"][i])):
                continue
            p = math.exp(min(r["rollout"][i], 0.0))
            out.append(
                {
                    "id": tid,
                    "trainer": r["trainer"][i],
                    "rollout": r["rollout"][i],
                    "position": position_label(i),
                    "probability": f"{min(int(p * 10), 9) / 10:.1f}-{(min(int(p * 10), 9) + 1) / 10:.1f}",
                    "turn": turn,
                    "token": int(r["ids"][i]),
                    "entropy": entropy_label(r["entropy"][i]) if "entropy" in r else None,
                    "worker": r["worker"],
                    "version": r["version"],
                    "staleness": r["step"] - 1 - r["version"],
                    "rollout_id": tid,
                }
            )
    return out


def token_numbers(chosen: list[dict[str, Any]]) -> dict[str, float]:
    """The numbers of a bucket's tokens; verl's as verl defines them (its means divide by the
    count + 1e-8, its ratios are clamped at exp(±20))."""
    trainer = np.array([t["trainer"] for t in chosen])
    rollout = np.array([t["rollout"] for t in chosen])
    lr = trainer - rollout
    rho = np.exp(np.clip(lr, -20, 20))
    w = np.minimum(rho, 2.0)
    count = len(chosen) + 1e-8

    def verl_mean(values: Any) -> float:
        return float(np.sum(values) / count)

    return {
        "tokens": len(chosen),
        "logprob_diff_mean": np.abs(lr).mean(),
        "logprob_diff_max": np.abs(lr).max(),
        "token_mult_prob_error": np.exp(np.abs(lr)).mean(),
        "kl": verl_mean(rollout - trainer),
        "k3_kl": verl_mean(np.exp(lr) - lr - 1),
        "chi2_token": verl_mean(rho**2) - 1,
        "tis_token_frac_high": verl_mean(rho > 2),
        "icepop_token_frac_out": verl_mean((rho < 0.5) | (rho > 5)),
        "eff_sample_size": 1 / verl_mean((w / (verl_mean(w) + 1e-8)) ** 2),
    }


def sequence_numbers(chosen: list[dict[str, Any]]) -> dict[str, float]:
    by_id: dict[str, list[dict[str, Any]]] = {}
    for t in chosen:
        by_id.setdefault(t["rollout_id"], []).append(t)
    ratio, diff, largest = [], [], []
    for members in by_id.values():
        trainer = np.array([t["trainer"] for t in members])
        rollout = np.array([t["rollout"] for t in members])
        ratio.append((trainer - rollout).sum())
        diff.append(rollout.mean() - trainer.mean())
        largest.append(np.abs(trainer - rollout).max())
    return {
        "sequences": len(by_id),
        "chi2_seq": np.mean(np.exp(2 * np.clip(ratio, -20, 20))) - 1,
        "log_ppl_diff": np.mean(diff),
        "seq_logprob_diff_max_p50": np.percentile(largest, 50),
        "seq_logprob_diff_max_p90": np.percentile(largest, 90),
    }


def near(got: Any, want: Any) -> bool:
    if isinstance(want, int):
        return got == want
    return got is not None and math.isclose(got, float(want), rel_tol=1e-7, abs_tol=1e-10)


@pytest.mark.parametrize(
    "key",
    ["position", "probability", "turn", "entropy", "worker", "version", "staleness", "token", "rollout"],
)
def test_each_bucket_is_numpys(planted: Path, key: str) -> None:
    every = tokens(responses(planted))
    field = "rollout_id" if key == "rollout" else key
    groups: dict[Any, list[dict[str, Any]]] = {}
    for t in every:
        groups.setdefault(t[field], []).append(t)
    rows = mismatch_json(str(planted), "--by", key, "--top", "0")
    assert {r["by"] for r in rows} == {key}
    got = {r["bucket"]: r for r in rows}
    if key == "probability":  # every tenth listed, those without tokens too
        assert list(got) == [f"{k / 10:.1f}-{(k + 1) / 10:.1f}" for k in range(10)]
        for label in set(got) - set(groups):
            assert got[label]["tokens"] == 0 and got[label]["logprob_diff_mean"] is None
    else:
        assert set(got) == set(groups)
    for label, chosen in groups.items():
        want = token_numbers(chosen)
        if key in ("worker", "version", "staleness", "rollout"):
            want.update(sequence_numbers(chosen))
        for name, value in want.items():
            assert near(got[label][name], value), (key, label, name, got[label][name], value)
    if key == "token":  # the largest total |Δ| first
        totals = [sum(abs(t["trainer"] - t["rollout"]) for t in groups[r["bucket"]]) for r in rows]
        assert totals == sorted(totals, reverse=True)
        assert all(near(r["logprob_diff_sum"], s) for r, s in zip(rows, totals))
    if key == "rollout":
        largest = [got[label]["logprob_diff_max"] for label in got]
        assert [r["logprob_diff_max"] for r in rows] == sorted(largest, reverse=True)


def test_top_keeps_the_largest_rollouts(planted: Path) -> None:
    every = mismatch_json(str(planted), "--by", "rollout", "--top", "0")
    top = mismatch_json(str(planted), "--by", "rollout", "--top", "3")
    assert [r["id"] for r in top] == [r["id"] for r in every[:3]]
    assert all(r["logprob_diff_max"] >= every[3]["logprob_diff_max"] for r in top)


def test_a_bucket_without_data_is_said(tmp_path: Path) -> None:
    proc = rlreplay_proc("mismatch", str(SHOWCASE), "--by", "entropy", "--json", cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout == ""
    assert "no entropy was recorded per token" in proc.stderr
    text = subprocess.run(
        [sys.executable, "-m", "rlreplay", "mismatch", str(SHOWCASE), "--by", "entropy"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert text.returncode == 0 and "no entropy was recorded per token" in text.stdout
    assert "by entropy: no buckets" in text.stdout
