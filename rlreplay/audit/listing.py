"""Checks over the listing (the run index: one row per trajectory): group collapse, mismatch
outliers, length and reward drift across steps. They read no span."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from rlreplay.audit.finding import (
    ERROR,
    LEVEL_GROUP,
    LEVEL_STEP,
    LEVEL_TRAJECTORY,
    OVER_LISTING,
    WARNING,
    Check,
    Context,
    Finding,
)
from rlreplay.model import listing_rows


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _by_step(rows: list[dict[str, Any]], train_only: bool) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        if train_only and row["validate"]:
            continue
        out.setdefault((row["step"], bool(row["validate"])), []).append(row)
    return out


def group_collapse(listing: Any, ctx: Context) -> Iterator[Finding]:
    groups: dict[tuple[Any, ...], list[float]] = {}
    for row in listing_rows(
        listing.select(
            [
                "step",
                "step_str",
                "sample_index",
                "sample_index_str",
                "rollout_n",
                "rollout_n_str",
                "validate",
                "reward",
            ]
        )
    ):
        if row["validate"] or row["sample_index"] is None or row["reward"] is None:
            continue
        groups.setdefault((row["step"], row["sample_index"]), []).append(row["reward"])
    for (step, sample), rewards in groups.items():
        if (
            len(rewards) >= ctx["collapse_min_rollouts"]
            and max(rewards) - min(rewards) <= ctx["collapse_tolerance"]
        ):
            yield Finding(
                "group_collapse",
                None,
                step,
                sample,
                None,
                False,
                WARNING,
                f"all {len(rewards)} rollouts got reward {rewards[0]:g} (zero advantage)",
                score=len(rewards),
            )


def mismatch(listing: Any, ctx: Context) -> Iterator[Finding]:
    cols = [
        "id",
        "step",
        "step_str",
        "sample_index",
        "sample_index_str",
        "rollout_n",
        "rollout_n_str",
        "validate",
        "logprob_diff_max",
        "importance_ratio",
    ]
    rows = listing_rows(listing.select(cols))
    for (_step, _split), members in _by_step(rows, train_only=False).items():
        diffs = [r["logprob_diff_max"] for r in members if r["logprob_diff_max"] is not None]
        limit = ctx["mismatch_max"]
        if len(diffs) >= ctx["mismatch_min_rollouts"]:
            median = _median(diffs)
            mad = _median([abs(d - median) for d in diffs])
            outlier = max(median + ctx["mismatch_mads"] * 1.4826 * mad, ctx["mismatch_floor"])
            limit = min(limit, outlier)
        ratio_max = ctx["importance_ratio_max"]
        for r in members:
            diff, ratio = r["logprob_diff_max"], r["importance_ratio"]
            parts = []
            score = 0.0
            if diff is not None and diff > limit:
                parts.append(f"logprob_diff_max {diff:.4g} > {limit:.4g} (step median {_median(diffs):.3g})")
                score = diff
            if ratio is not None and ratio > 0 and abs(math.log(ratio)) > math.log(ratio_max):
                parts.append(f"importance_ratio {ratio:.4g} outside [{1 / ratio_max:.3g}, {ratio_max:.3g}]")
                score = max(score, abs(math.log(ratio)))
            if parts:
                severity = ERROR if (diff or 0) > ctx["mismatch_max"] else WARNING
                yield Finding(
                    "mismatch",
                    r["id"],
                    r["step"],
                    r["sample_index"],
                    r["rollout_n"],
                    r["validate"],
                    severity,
                    "; ".join(parts),
                    score=score,
                )


def _step_means(listing: Any, column: str) -> list[tuple[Any, float, float, float | None]]:
    """Per training step, in order: (step, mean of ``column``, mean reward, tool success rate)."""
    cols = ["step", "step_str", "validate", column, "reward", "tool_calls", "tool_errors"]
    out = []
    by_step = _by_step(listing_rows(listing.select(cols)), train_only=True)
    for (step, _split), members in sorted(
        by_step.items(), key=lambda kv: (isinstance(kv[0][0], str), kv[0][0])
    ):
        values = [r[column] for r in members if r[column] is not None]
        rewards = [r["reward"] for r in members if r["reward"] is not None]
        calls = sum(r["tool_calls"] or 0 for r in members)
        errors = sum(r["tool_errors"] or 0 for r in members)
        if values and rewards:
            success = (calls - errors) / calls if calls else None
            out.append((step, sum(values) / len(values), sum(rewards) / len(rewards), success))
    return out


def _halves(points: list[Any], ctx: Context) -> tuple[list[Any], list[Any]] | None:
    if len(points) < ctx["drift_min_steps"]:
        return None
    k = max(1, len(points) // 3)
    return points[:k], points[-k:]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def length_drift(listing: Any, ctx: Context) -> Iterator[Finding]:
    points = _step_means(listing, "response_tokens")
    ends = _halves(points, ctx)
    if ends is None:
        return
    first, last = ends
    len0, len1 = _mean([p[1] for p in first]), _mean([p[1] for p in last])
    rew0, rew1 = _mean([p[2] for p in first]), _mean([p[2] for p in last])
    if len0 > 0 and (len1 - len0) / len0 >= ctx["length_rise"] and rew1 - rew0 <= ctx["reward_flat"]:
        yield Finding(
            "length_drift",
            None,
            f"{points[0][0]}..{points[-1][0]}",
            None,
            None,
            False,
            WARNING,
            f"mean response tokens {len0:.1f} -> {len1:.1f} (+{(len1 - len0) / len0:.0%}) while mean reward "
            f"{rew0:.3g} -> {rew1:.3g}",
            score=(len1 - len0) / len0,
        )


def reward_drift(listing: Any, ctx: Context) -> Iterator[Finding]:
    points = [p for p in _step_means(listing, "reward") if p[3] is not None]
    ends = _halves(points, ctx)
    if ends is None:
        return
    first, last = ends
    rew0, rew1 = _mean([p[2] for p in first]), _mean([p[2] for p in last])
    ok0, ok1 = _mean([p[3] for p in first]), _mean([p[3] for p in last])
    if rew1 - rew0 >= ctx["reward_rise"] and ok0 - ok1 >= ctx["success_drop"]:
        yield Finding(
            "reward_drift",
            None,
            f"{points[0][0]}..{points[-1][0]}",
            None,
            None,
            False,
            WARNING,
            f"mean reward {rew0:.3g} -> {rew1:.3g} while tool success rate {ok0:.0%} -> {ok1:.0%}",
            score=ok0 - ok1,
        )


GROUP_COLLAPSE = Check(
    "group_collapse",
    OVER_LISTING,
    LEVEL_GROUP,
    "a training group (step, sample_index) whose rollouts all got the same reward: zero advantage "
    "under GRPO (one finding per group)",
    group_collapse,
    {"collapse_min_rollouts": 2, "collapse_tolerance": 0.0},
)
MISMATCH = Check(
    "mismatch",
    OVER_LISTING,
    LEVEL_TRAJECTORY,
    "a rollout whose trainer-vs-rollout logprob_diff_max is an outlier for its step (median + "
    "mismatch_mads MADs, at least mismatch_floor) or above --mismatch-max, or whose importance_ratio "
    "is beyond importance_ratio_max either way",
    mismatch,
    {
        "mismatch_max": 1.0,
        "mismatch_mads": 10.0,
        "mismatch_floor": 0.1,
        "mismatch_min_rollouts": 8,
        "importance_ratio_max": 2.0,
    },
)
LENGTH_DRIFT = Check(
    "length_drift",
    OVER_LISTING,
    LEVEL_STEP,
    "mean response length rising by length_rise (fraction) from the first third of the training "
    "steps to the last while mean reward rises less than reward_flat (a reward-hacking sign)",
    length_drift,
    {"length_rise": 0.5, "reward_flat": 0.05, "drift_min_steps": 3},
)
REWARD_DRIFT = Check(
    "reward_drift",
    OVER_LISTING,
    LEVEL_STEP,
    "mean reward rising by reward_rise from the first third of the training steps to the last while "
    "the tool success rate falls by success_drop (a reward-hacking sign)",
    reward_drift,
    {"reward_rise": 0.1, "success_drop": 0.1, "drift_min_steps": 3},
)
