"""Checks over the listing (the run index: one row per trajectory): group collapse, mismatch
outliers, length and reward drift across steps. They read no span."""

from __future__ import annotations

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
    finding_about,
)
from rlreplay.format import arrow_ops as ops
from rlreplay.format.keys import GROUP_KEYS, KEY_STR, KEYS, TrajectoryKey, group_key
from rlreplay.format.kinds import KIND_SIGNALS
from rlreplay.model import listing_rows


def _by_step(rows: list[dict[str, Any]], train_only: bool) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        if train_only and row["validate"]:
            continue
        out.setdefault((row["step"], bool(row["validate"])), []).append(row)
    return out


def _numbers(column: Any) -> Any:
    """A numeric column as floats, null as nan."""
    values = ops.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(float)
    values[ops.is_null(column).to_numpy(zero_copy_only=False)] = float("nan")
    return values


def _int_keys(listing: Any, names: tuple[str, ...]) -> list[tuple[Any, Any]] | None:
    """Each key column as (int64 values, null mask), nulls as 0 (exact: a float holds 53 bits), or
    None when a value was recorded as a string."""
    if any(listing[f"{name}_str"].null_count < listing.num_rows for name in names):
        return None
    out = []
    for name in names:
        column = listing[name]
        out.append(
            (
                ops.fill_null(column, 0).to_numpy(zero_copy_only=False).astype("int64"),
                ops.is_null(column).to_numpy(zero_copy_only=False),
            )
        )
    return out


def _groups(*keys: Any) -> tuple[Any, Any]:
    """(row order, start of each group in that order) of rows sorted by ``keys`` (a float key's nan
    is a key of its own)."""
    import numpy as np

    order = np.lexsort(keys[::-1])
    if not len(order):
        return order, np.zeros(0, dtype=np.int64)
    changed = np.zeros(len(order) - 1, dtype=bool)
    for key in keys:
        k = key[order]
        differ = k[1:] != k[:-1]
        if k.dtype.kind == "f":
            differ &= ~(np.isnan(k[1:]) & np.isnan(k[:-1]))
        changed |= differ
    return order, np.flatnonzero(np.r_[True, changed])


def group_collapse(listing: Any, ctx: Context) -> Iterator[Finding]:
    import numpy as np

    keys = _int_keys(listing, GROUP_KEYS)
    if keys is None:
        yield from _group_collapse_rows(listing, ctx)
        return
    (step, no_step), (sample, no_sample) = keys
    reward = _numbers(listing["reward"])
    train = ~ops.fill_null(listing["validate"], False).to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(train & ~no_sample & ~np.isnan(reward))
    order, starts = _groups(no_step[rows], step[rows], sample[rows])
    if not len(starts):
        return
    r = reward[rows][order]
    counts = np.diff(np.r_[starts, len(r)])
    spread = np.maximum.reduceat(r, starts) - np.minimum.reduceat(r, starts)
    first = rows[order][starts]
    for g in np.flatnonzero((counts >= ctx["collapse_min_rollouts"]) & (spread <= ctx["collapse_tolerance"])):
        i = first[g]
        yield _collapsed(
            None if no_step[i] else int(step[i]), int(sample[i]), int(counts[g]), float(reward[i])
        )


def _collapsed(step: Any, sample: Any, n: int, reward: float) -> Finding:
    return finding_about(
        "group_collapse",
        None,
        TrajectoryKey(step, sample),
        WARNING,
        f"all {n} rollouts got reward {reward:g} (zero advantage)",
        score=n,
    )


def _group_collapse_rows(listing: Any, ctx: Context) -> Iterator[Finding]:
    """group_collapse over keys recorded as strings: row by row."""
    groups: dict[tuple[Any, ...], list[float]] = {}
    for row in listing_rows(listing.select([*_KEY_COLUMNS, "validate", "reward"])):
        if row["validate"] or row["sample_index"] is None or row["reward"] is None:
            continue
        groups.setdefault(group_key(row), []).append(row["reward"])
    for (step, sample), rewards in groups.items():
        if (
            len(rewards) >= ctx["collapse_min_rollouts"]
            and max(rewards) - min(rewards) <= ctx["collapse_tolerance"]
        ):
            yield _collapsed(step, sample, len(rewards), rewards[0])


_KEY_COLUMNS = (*KEYS, *KEY_STR.values())


def mismatch(listing: Any, ctx: Context) -> Iterator[Finding]:
    report = _mismatch_report(listing, ctx)
    if report is not None:
        yield from _mismatch_steps(report, ctx)
    yield from _mismatch_rollouts(listing, ctx, report)


def _mismatch_report(listing: Any, ctx: Context) -> Any:
    """``rlreplay mismatch``'s report of the listing (the same numbers), where the run keeps the
    trainer's per-token log-probs and ``mismatch_steps`` is on; else None."""
    from rlreplay.mismatch.report import compute, has_trainer_logprobs

    if ctx.run is None or not ctx["mismatch_steps"] or not listing.num_rows:
        return None
    fields = getattr(ctx.adapter, "fields", None)
    if not has_trainer_logprobs(ctx.run, listing, fields):
        return None
    limits = {"investigate": ctx["mismatch_investigate"], "broken": ctx["mismatch_broken"]}
    pieces = counts = None
    if ctx.pieces is not None:  # made on a cluster
        pieces, counts = ctx.pieces(listing, (limits["investigate"], limits["broken"]))
    return compute(ctx.run, listing, fields=fields, token_ids=False, pieces=pieces, counts=counts, **limits)


def _mismatch_steps(report: Any, ctx: Context) -> Iterator[Finding]:
    """Per step and split, ``rlreplay mismatch``'s verdict: investigate and broken are findings."""
    for row in report.steps:
        if row["verdict"] not in ("investigate", "broken"):
            continue
        mult = row["token_mult_prob_error"]
        if row["verdict"] == "broken":
            over = f"{ctx['mismatch_broken']:g} (the TIS cap: broken)"
        else:
            over = f"{ctx['mismatch_investigate']:g} (NeMo-RL's threshold: investigate)"
        detail = (
            f"token_mult_prob_error {mult:.4g} > {over} over {row['tokens']} model tokens of "
            f"{row['sequences']} rollouts; logprob_diff_mean {row['logprob_diff_mean']:.3g}, "
            f"p99 {row['logprob_diff_p99']:.3g}, max {row['logprob_diff_max']:.3g}; ratios beyond the "
            f"TIS cap {row['tis_token_frac_high']:.3g}, outside IcePop {row['icepop_token_frac_out']:.3g}"
        )
        yield finding_about(
            "mismatch",
            None,
            TrajectoryKey(row["step"], validate=row["validate"]),
            ERROR if row["verdict"] == "broken" else WARNING,
            detail,
            score=float(mult),
        )


def _mismatch_rollouts(listing: Any, ctx: Context, report: Any = None) -> Iterator[Finding]:
    """Rollouts whose largest |Δ| is an outlier for their step, or whose importance ratio is far:
    the largest |Δ| the trainer recorded (``logprob_diff_max``), else the report's."""
    import numpy as np

    diff = _numbers(listing["logprob_diff_max"])
    if report is not None:
        unknown = np.isnan(diff)
        diff[unknown] = report.largest_gaps[unknown]
    ratio = _numbers(listing["importance_ratio"])
    steps = _int_keys(listing, ("step",))
    if steps is None:  # steps recorded as strings: number them
        names = [str(s) for s in listing_rows(listing.select(["step", "step_str"]))]
        steps = [(np.unique(names, return_inverse=True)[1], np.zeros(len(names), dtype=bool))]
    (step, no_step) = steps[0]
    split = ops.fill_null(listing["validate"], False).to_numpy(zero_copy_only=False)
    limit = np.full(len(diff), ctx["mismatch_max"])
    median = np.full(len(diff), np.nan)
    order, starts = _groups(no_step, step, split)
    for lo, hi in zip(starts, np.r_[starts[1:], len(order)]):
        members = order[lo:hi]
        values = diff[members][~np.isnan(diff[members])]
        if not len(values):
            continue
        med = float(np.median(values))
        median[members] = med
        if len(values) >= ctx["mismatch_min_rollouts"]:
            mad = float(np.median(np.abs(values - med)))
            outlier = max(med + ctx["mismatch_mads"] * 1.4826 * mad, ctx["mismatch_floor"])
            limit[members] = min(ctx["mismatch_max"], outlier)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_ratio = np.abs(np.log(ratio))
    far = log_ratio > np.log(ctx["importance_ratio_max"])
    high = diff > limit
    flagged = np.flatnonzero(high | far)
    if not len(flagged):
        return
    rows = listing_rows(ops.take(listing.select(["id", *_KEY_COLUMNS, "validate"]), ops.from_numpy(flagged)))
    tokens = _worst_tokens(ctx, ops.take(listing, ops.from_numpy(flagged)), int(ctx["mismatch_tokens"]))
    ratio_max = ctx["importance_ratio_max"]
    for i, r in zip(flagged, rows):
        parts, score, position = [], 0.0, None
        if high[i]:
            parts.append(f"logprob_diff_max {diff[i]:.4g} > {limit[i]:.4g} (step median {median[i]:.3g})")
            score = float(diff[i])
        worst = tokens.get(r["id"])
        if worst:
            position = worst[0][0]
            parts.append(
                "worst tokens (position id |diff|): "
                + ", ".join(f"{at} {token} {gap:.3g}" for at, token, gap in worst)
            )
        if far[i]:
            parts.append(f"importance_ratio {ratio[i]:.4g} outside [{1 / ratio_max:.3g}, {ratio_max:.3g}]")
            score = max(score, float(log_ratio[i]))
        severity = ERROR if diff[i] > ctx["mismatch_max"] else WARNING
        yield finding_about(
            "mismatch",
            r["id"],
            TrajectoryKey.from_row(r),
            severity,
            "; ".join(parts),
            position=position,
            score=score,
        )


def _worst_tokens(ctx: Context, flagged: Any, keep: int) -> dict[str, list[tuple[int, Any, float]]]:
    """Per flagged trajectory whose trainer log-probs were recorded per token (``--token-signals``:
    a signals span's ``old_log_probs``): its ``keep`` counted tokens (``rlreplay.mismatch``: model
    tokens with both log-probs) of largest |trainer - rollout| log-prob difference, worst first,
    as (position in the response, token id, |difference|)."""
    import numpy as np

    from rlreplay.format.kinds import KIND_AGENT, KIND_LLM
    from rlreplay.mismatch.tokens import of_trajectory
    from rlreplay.read.filters import Filters
    from rlreplay.read.scan import by_step

    if ctx.run is None or keep <= 0 or not flagged.num_rows:
        return {}
    fields = getattr(ctx.adapter, "fields", None)
    out: dict[str, list[tuple[int, Any, float]]] = {}
    loaded = (  # the few flagged: only the row groups that hold them
        traj
        for step, ids in by_step(flagged).items()
        for traj in ctx.run.load(
            ids, Filters(step=step) if type(step) is int else None, kinds=(KIND_AGENT, KIND_LLM, KIND_SIGNALS)
        )
    )
    for traj in loaded:
        response = of_trajectory(traj, fields)
        if response is None:
            continue
        if not np.isfinite(response.trainer).any():
            if not out:
                break  # --token-signals is a run-wide setting: the first flagged tells for all
            continue
        counted = np.flatnonzero(response.counted)
        gap = np.abs(response.trainer - response.rollout)[counted]
        order = counted[np.argsort(-gap, kind="stable")][:keep]
        out[traj.id] = [
            (int(i), int(response.ids[i]), float(abs(response.trainer[i] - response.rollout[i])))
            for i in order
        ]
    return out


def _step_means(listing: Any, column: str) -> list[tuple[Any, float, float, float | None]]:
    """Per training step, in order: (step, mean of ``column``, mean reward, tool success rate)."""
    cols = ["step", "step_str", "validate", column, "reward", "tool_calls", "tool_errors"]
    out = []
    by_step = _by_step(listing_rows(listing.select(cols)), train_only=True)
    # a trajectory that recorded no step has no place in a trend
    for (step, _split), members in sorted(
        ((key, rows) for key, rows in by_step.items() if key[0] is not None),
        key=lambda kv: (isinstance(kv[0][0], str), kv[0][0]),
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


def _drift(check: str, points: list[Any], detail: str, score: float) -> Finding:
    """A finding over training steps: about their range (``1..6``)."""
    return finding_about(
        check, None, TrajectoryKey(f"{points[0][0]}..{points[-1][0]}"), WARNING, detail, score=score
    )


def length_drift(listing: Any, ctx: Context) -> Iterator[Finding]:
    points = _step_means(listing, "response_tokens")
    ends = _halves(points, ctx)
    if ends is None:
        return
    first, last = ends
    len0, len1 = _mean([p[1] for p in first]), _mean([p[1] for p in last])
    rew0, rew1 = _mean([p[2] for p in first]), _mean([p[2] for p in last])
    if len0 > 0 and (len1 - len0) / len0 >= ctx["length_rise"] and rew1 - rew0 <= ctx["reward_flat"]:
        detail = f"mean response tokens {len0:.1f} -> {len1:.1f} (+{(len1 - len0) / len0:.0%})"
        yield _drift(
            "length_drift",
            points,
            f"{detail} while mean reward {rew0:.3g} -> {rew1:.3g}",
            (len1 - len0) / len0,
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
        detail = f"mean reward {rew0:.3g} -> {rew1:.3g} while tool success rate {ok0:.0%} -> {ok1:.0%}"
        yield _drift("reward_drift", points, detail, ok0 - ok1)


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
    "is beyond importance_ratio_max either way; where the trainer's per-token log-probs were recorded "
    "(record --token-signals), names its mismatch_tokens worst tokens and their positions, and flags "
    "each step whose `rlreplay mismatch` verdict is investigate (token_mult_prob_error above "
    "mismatch_investigate) or broken (above mismatch_broken); mismatch_steps=0 leaves steps out",
    mismatch,
    {
        "mismatch_max": 1.0,
        "mismatch_mads": 10.0,
        "mismatch_floor": 0.1,
        "mismatch_min_rollouts": 8,
        "importance_ratio_max": 2.0,
        "mismatch_tokens": 3,
        "mismatch_steps": 1.0,
        "mismatch_investigate": 1.05,
        "mismatch_broken": 2.0,
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
