"""Following a run while it is recorded (``rlreplay watch``): each step, once its shards are sealed,
goes through the audit checks and the mismatch figures, then through trend checks against the
run's own earlier steps; what changed becomes an alert naming the trajectories behind it.

The watch reads only sealed shards and keeps a few numbers per step for the last ``WINDOW``
steps: its memory is one step's reading plus that window. It opens the run again at every look,
so nothing read of earlier steps stays cached.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlreplay.errors import RunError

#: Earlier steps a step is compared with.
WINDOW = 10
#: Earlier steps a trend check needs before it alerts (the first steps set the baseline).
BASELINE_STEPS = 2
#: A share must also rise this many standard deviations (over the earlier steps) to alert.
NOISE_SIGMAS = 3.0
#: The watch's own thresholds (``--threshold KEY=VALUE``, beside the audit checks' ones).
THRESHOLDS: dict[str, float] = {
    # a check alerts when the share of a step's trajectories it flags rises this much (and
    # NOISE_SIGMAS standard deviations) above its mean share over the earlier steps ...
    "alert_jump": 0.2,
    # ... and flags at least this many trajectories ...
    "alert_min": 2.0,
    # ... and so many would come by chance at the earlier steps' rate with at most this
    # probability (binomial; what a few rollouts a step cannot tell from noise does not alert)
    "alert_p": 0.01,
    # mean training reward this far below the earlier steps' mean: reward collapse
    "reward_drop": 0.3,
    # mean response length up this fraction from the earlier steps' mean: length drift
    "length_growth": 0.5,
}
#: Shares are ratios of counts: a rise of exactly the threshold counts despite rounding.
EPSILON = 1e-9
#: Trajectories an alert names; more are counted in its ``count``.
NAMED = 50
#: Mismatch verdicts worth an alert, in rising order of gravity.
BAD_VERDICTS = ("investigate", "broken")
#: Seconds a step must have been left alone (a later step begun) before it is taken as whole.
SETTLE_S = 1.0
#: Manifest statuses of a run that ended (``rlreplay record`` writes them with ``ended_at``).
ENDED = ("finished", "failed", "not started")


@dataclass
class Alert:
    step: int
    check: str
    severity: str
    message: str
    #: the trajectories behind it, worst first (at most ``NAMED``)
    trajectories: list[str]
    #: how many trajectories are behind it (``trajectories`` may name fewer)
    count: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": "alert",
            "step": self.step,
            "check": self.check,
            "severity": self.severity,
            "message": self.message,
            "trajectories": self.trajectories,
            "count": self.count,
        }


@dataclass
class StepSummary:
    """What the trend checks keep of a step."""

    step: int
    trajectories: int
    #: per check: the share of the step's trajectories it flags
    shares: dict[str, float]
    reward: float | None
    response_tokens: float | None
    verdict: str | None


@dataclass
class StepResult:
    event: dict[str, Any]
    alerts: list[Alert] = field(default_factory=list)


def run_ended(run: Any) -> bool:
    """Whether the recorder marked the run ended (``rlreplay record`` does when its job exits)."""
    data = run.manifest
    return data.get("ended_at") is not None or data.get("status") in ENDED


def int_steps(run: Any) -> list[int]:
    """The run's integer steps that have a folder, in order."""
    from rlreplay.format.keys import parse_int

    return sorted(s for s in (parse_int(p) for p in run.step_partitions()) if s is not None)


def sealed_steps(
    run: Any, ended: bool, after: int | None = None, now: float | None = None
) -> Iterator[tuple[int, float]]:
    """(step, when its newest shard was sealed) of each step after ``after`` whose files are all
    sealed and that no process writes to any more: the run ended, or a later step began and
    nothing of the step was written for ``SETTLE_S`` (what a trainer records of a step after its
    rollouts, its signals, has landed by then). In order; stops at the first step still being
    written."""
    steps = int_steps(run)
    now = time.time() if now is None else now
    for k, step in enumerate(steps):
        if after is not None and step <= after:
            continue
        if k == len(steps) - 1 and not ended:
            return  # the newest step: its processes may still write it
        sealed, live = run.span_files(step)
        if live:
            return
        if not sealed:
            continue
        newest = max(run.store.stamp(p)[1] for p in sealed) / 1e9
        if not ended and now - newest < SETTLE_S:
            return
        yield step, newest


@dataclass
class StepReading:
    """What a step's files say, for the trend checks: kept as long as the step's files are as read."""

    step: int
    #: the step's listing rows (``ROW_COLUMNS``)
    rows: list[dict[str, Any]]
    #: per check that ran: the trajectories it flags, worst first
    flagged: dict[str, list[str]]
    #: a check's severity when not "warning"
    severities: dict[str, str]
    #: the training responses' mismatch verdict (None: nothing to compare)
    verdict: str | None
    #: the responses with the largest trainer-rollout gap
    worst: list[str]
    #: checks that could not run, and why
    notes: dict[str, str]


def read_step(
    run: Any,
    step: int,
    checks: Sequence[Any],
    thresholds: dict[str, float] | None = None,
    tokenizer: str | None = None,
) -> StepReading:
    """One step of ``run`` through the audit ``checks`` (``thresholds``: audit ones, watch's own
    are left out) and the mismatch figures, as ``rlreplay audit --step S`` and ``rlreplay
    mismatch --step S`` read it."""
    from rlreplay.audit import engine
    from rlreplay.format.arrow_ops import release_unused
    from rlreplay.model import listing_rows
    from rlreplay.read.selection import Selection

    listing = Selection(step=str(step)).trajectories(run)
    audit_thresholds = {k: v for k, v in (thresholds or {}).items() if k not in THRESHOLDS}
    report = engine.audit(run, listing, checks, audit_thresholds, tokenizer)
    verdict, worst = _mismatch(run, listing)
    release_unused()
    return StepReading(
        step,
        listing_rows(listing.select([c for c in ROW_COLUMNS if c in listing.column_names])),
        _flagged_by_check(report, listing),
        {f.check: f.severity for f in report.findings if f.severity == "error"},
        verdict,
        worst,
        {**report.skipped, **report.failed},
    )


class Watcher:
    """The per-step analysis and the trend checks, with the window of earlier steps."""

    def __init__(
        self,
        checks: Sequence[Any],
        thresholds: dict[str, float] | None = None,
        tokenizer: str | None = None,
        window: int = WINDOW,
    ) -> None:
        from rlreplay.audit import engine

        self.checks = list(checks)
        self.thresholds = {**THRESHOLDS, **engine.default_thresholds(self.checks), **(thresholds or {})}
        self.tokenizer = tokenizer
        self.history: deque[StepSummary] = deque(maxlen=window)
        #: checks that could not run (skipped or failed), and why: said once
        self.notes: dict[str, str] = {}

    def step(self, run: Any, step: int) -> StepResult:
        """Read the step and take it (its summary joins the window)."""
        cpu = time.process_time()
        reading = read_step(run, step, self.checks, self.thresholds, self.tokenizer)
        result = self.take(reading)
        # what reading and checking the step cost this process (the cost of watching)
        result.event["cpu_s"] = round(time.process_time() - cpu, 4)
        return result

    def take(self, reading: StepReading) -> StepResult:
        """The event and the alerts of a step read (its summary joins the window)."""
        for name, why in reading.notes.items():
            self.notes.setdefault(name, why)
        rows = reading.rows
        summary = summarize(reading.step, rows, reading.flagged, reading.verdict)
        alerts = self.judge(summary, rows, reading.flagged, reading.severities, reading.worst)
        train = [r for r in rows if not r["validate"]]
        advantages = [r["advantage"] for r in train if r.get("advantage") is not None]
        tools = sum(r["tool_calls"] or 0 for r in train)
        event = {
            "event": "step",
            "step": reading.step,
            "trajectories": len(rows),
            "reward": _round(summary.reward),
            "advantage_std": _round(_std(advantages)),
            "response_tokens": _round(summary.response_tokens),
            "tool_error_rate": _round(sum(r["tool_errors"] or 0 for r in train) / tools if tools else None),
            "mismatch": reading.verdict,
            "findings": {name: len(ids) for name, ids in reading.flagged.items()},
        }
        return StepResult(event, alerts)

    def judge(
        self,
        now: StepSummary,
        rows: list[dict[str, Any]],
        flagged: dict[str, list[str]],
        severities: dict[str, str] | None = None,
        worst_mismatch: Sequence[str] = (),
    ) -> list[Alert]:
        """The alerts of step ``now`` against the steps before it (``rows``: its listing rows with
        ``ROW_COLUMNS``; ``flagged``: per check, the trajectories it flags, worst first;
        ``severities``: a check's severity when not "warning"; ``worst_mismatch``: the responses
        with the largest trainer-rollout gap). The step then joins the window."""
        alerts = self._alerts(now, rows, flagged, severities or {}, list(worst_mismatch))
        self.history.append(now)
        return alerts

    def _alerts(
        self,
        now: StepSummary,
        rows: list[dict[str, Any]],
        flagged: dict[str, list[str]],
        severity: dict[str, str],
        worst_mismatch: list[str],
    ) -> list[Alert]:
        t = self.thresholds
        earlier = list(self.history)
        out: list[Alert] = []
        trend = len(earlier) >= BASELINE_STEPS
        for name, ids in flagged.items():
            share = now.shares.get(name, 0.0)
            before = [h.shares.get(name, 0.0) for h in earlier]
            base = _mean(before) or 0.0
            rise = max(t["alert_jump"], NOISE_SIGMAS * (_std(before) or 0.0))
            if (
                trend
                and share - base >= rise - EPSILON
                and len(ids) >= t["alert_min"]
                and chance(len(ids), now.trajectories, earlier, name) <= t["alert_p"]
            ):
                since = f"{base:.0%} over the {len(earlier)} steps before"
                out.append(
                    _alert(
                        now.step,
                        name,
                        severity.get(name, "warning"),
                        f"{name}: {len(ids)} of {now.trajectories} trajectories ({share:.0%}), {since}",
                        ids,
                    )
                )
        if now.verdict in BAD_VERDICTS:
            before = next((h.verdict for h in reversed(earlier) if h.verdict is not None), None)
            rank = BAD_VERDICTS.index
            if before not in BAD_VERDICTS or rank(now.verdict) > rank(before):
                out.append(
                    _alert(
                        now.step,
                        "mismatch_verdict",
                        "error" if now.verdict == "broken" else "warning",
                        f"mismatch verdict {now.verdict} (was {before or 'ok'}): trainer and rollout "
                        "log-probs part; the responses with the largest gap named",
                        worst_mismatch,
                    )
                )
        train = [r for r in rows if not r["validate"]]
        rewards = [h.reward for h in earlier if h.reward is not None]
        if now.reward is not None and trend and rewards:
            base = _mean(rewards) or 0.0
            if base - now.reward >= t["reward_drop"]:
                cut = base - t["reward_drop"]
                low = sorted(
                    (r for r in train if r.get("reward") is not None and r["reward"] < cut),
                    key=lambda r: r["reward"],
                )
                out.append(
                    _alert(
                        now.step,
                        "reward_collapse",
                        "error",
                        f"mean reward {now.reward:.3g}, down from {base:.3g} over the {len(rewards)} steps "
                        f"before; trajectories below {cut:.3g} named",
                        [r["id"] for r in low],
                    )
                )
        lengths = [h.response_tokens for h in earlier if h.response_tokens]
        if now.response_tokens is not None and trend and lengths:
            base = _mean(lengths) or 0.0
            limit = base * (1 + t["length_growth"])
            if now.response_tokens > limit:
                long = sorted(
                    (r for r in train if (r["response_tokens"] or 0) > limit),
                    key=lambda r: -(r["response_tokens"] or 0),
                )
                out.append(
                    _alert(
                        now.step,
                        "length_drift",
                        "warning",
                        f"mean response length {now.response_tokens:.0f} tokens, up from {base:.0f} over "
                        f"the {len(lengths)} steps before; responses over {limit:.0f} named",
                        [r["id"] for r in long],
                    )
                )
        return out


def chance(flagged: int, n: int, earlier: Sequence[StepSummary], check: str) -> float:
    """The probability of ``flagged`` or more of ``n`` trajectories flagged by ``check`` at the
    rate of the ``earlier`` steps (binomial; the rate's estimate (k + 1/2) / (n + 1) is never 0)."""
    k_before = sum(round(h.shares.get(check, 0.0) * h.trajectories) for h in earlier)
    n_before = sum(h.trajectories for h in earlier)
    return binomial_tail(flagged, n, (k_before + 0.5) / (n_before + 1))


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), 0 < p < 1 (summed in log space: any n)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    total = 0.0
    for i in range(k, n + 1):
        term = math.exp(base - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
        total += term
        if i > n * p and term < total * 1e-17:  # past the mode, the rest adds nothing
            break
    return min(1.0, total)


#: The listing columns the trend checks read.
ROW_COLUMNS = ("id", "validate", "reward", "advantage", "response_tokens", "tool_calls", "tool_errors")


def _alert(step: int, check: str, severity: str, message: str, ids: list[str]) -> Alert:
    return Alert(step, check, severity, message, ids[:NAMED], len(ids))


def _flagged_by_check(report: Any, listing: Any) -> dict[str, list[str]]:
    """Per check that ran: the ids of the trajectories its findings point at (a group finding:
    the group's rollouts), worst first."""
    from rlreplay.audit import engine

    by_check: dict[str, list[Any]] = {c.name: [] for c in report.checks if c.name not in report.skipped}
    for finding in report.findings:
        by_check.setdefault(finding.check, []).append(finding)
    out: dict[str, list[str]] = {}
    for name, found in by_check.items():
        found.sort(key=lambda f: -f.score)
        ids = engine.finding_ids(engine.Report(report.checks, found), listing)
        ranked = list(dict.fromkeys(f.trajectory_id for f in found if f.trajectory_id in ids))
        out[name] = ranked + sorted(ids - set(ranked))
    return out


def _mismatch(run: Any, listing: Any) -> tuple[str | None, list[str]]:
    """The step's mismatch verdict over its training responses (None: nothing to compare) and the
    responses with the largest gap."""
    from rlreplay.mismatch.report import LISTING_COLUMNS, compute

    try:
        report = compute(run, listing.select(LISTING_COLUMNS), token_ids=False)
    except RunError:
        return None, []
    verdicts = [r["verdict"] for r in report.steps if not r["validate"] and r.get("verdict")]
    worst = [r["id"] for r in report.worst_rollouts if r.get("id")]
    return (max(verdicts, key=_gravity) if verdicts else None), worst


def _gravity(verdict: str) -> int:
    return BAD_VERDICTS.index(verdict) + 1 if verdict in BAD_VERDICTS else 0


def summarize(
    step: int, rows: list[dict[str, Any]], flagged: dict[str, list[str]], verdict: str | None
) -> StepSummary:
    """What the trend checks keep of a step: its size, each check's share, its training rows' mean
    reward and response length, its mismatch verdict."""
    train = [r for r in rows if not r["validate"]]
    n = len(rows)
    return StepSummary(
        step,
        n,
        {name: len(ids) / n for name, ids in flagged.items()} if n else {},
        _mean([r["reward"] for r in train if r.get("reward") is not None]),
        _mean([r["response_tokens"] for r in train if r["response_tokens"] is not None]),
        verdict,
    )


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _std(values: list[float]) -> float | None:
    mean = _mean(values)
    if mean is None:
        return None
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


#: Looks in a row that may fail to read the run (a store or file system away for a while) before
#: the watch gives up: with the default interval, about a minute.
FAILED_LOOKS = 30


def follow(
    open_run: Callable[[], Any],
    watcher: Watcher,
    emit: Callable[[Any, StepResult, float], None],
    from_step: int | None = None,
    interval: float = 2.0,
    warn: Callable[[str], None] = lambda message: None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Watch the run until it ends: each sealed step (from ``from_step``) goes through ``watcher``
    and to ``emit`` with the run as read at that look and the time the step's newest shard was
    sealed. A look that cannot read the run (``RunError``) is said to ``warn`` and tried again
    at the next; after ``FAILED_LOOKS`` in a row the error is raised. Returns the steps seen."""
    done: int | None = None if from_step is None else from_step - 1
    seen = failed = 0
    while True:
        try:
            run = open_run()  # afresh each look: nothing of earlier steps stays cached
            ended = run_ended(run)
            for step, sealed_at in list(sealed_steps(run, ended, done)):
                emit(run, watcher.step(run, step), sealed_at)
                done = step
                seen += 1
        except RunError as exc:
            failed += 1
            if failed >= FAILED_LOOKS:
                raise
            warn(f"cannot read the run now ({exc}); trying again")
        else:
            failed = 0
            if ended:
                return seen
            del run
        sleep(interval)
