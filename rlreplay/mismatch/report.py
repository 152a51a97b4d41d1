"""The mismatch report of a selection of a run: per step and split, by a bucket key, the trend, and
the worst responses and tokens. ``rlreplay mismatch``, the audit's ``mismatch`` check and the
UI's mismatch page all show what :func:`compute` returns.

The run is read a step at a time (``rlreplay.mismatch.tokens.read_batches``): memory holds one
step's tokens, a few sums per response and per bucket, and the worst tokens seen so far. What a
step adds is a :class:`Piece`, and a step may come as several (``--engine ray`` cuts a large
step between samples): its figures are made once its pieces are folded, the same floats either
way.

A selection without the trainer's per-token log-probs gets the per-rollout figures the trainer
recorded, when it did (:func:`per_rollout`, ``Report.per == "rollout"``); one with neither raises
``NothingToCompare``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlreplay.errors import NothingToCompare, RunError, SelectionError
from rlreplay.format import arrow_ops as ops
from rlreplay.format.keys import KEY_STR, KEYS, key_order
from rlreplay.mismatch import BY
from rlreplay.mismatch import metrics as m
from rlreplay.mismatch.tokens import (
    HOW_TO_RECORD_CALLS,
    HOW_TO_RECORD_SHORT,
    Batch,
    Counts,
    by_step,
    read_batches,
)
from rlreplay.model import listing_rows
from rlreplay.text.conversation import RESPONSE_IN_CALLS

#: Worst responses and tokens a report keeps.
WORST = 20
#: The metric the trend is drawn from (per token; per rollout).
TREND_METRIC = "logprob_diff_mean"
ROLLOUT_TREND_METRIC = "seq_logprob_diff_mean"
#: What a response is known by in a report's rows.
ROW_KEYS = ("id", *KEYS, "validate", "worker")
#: The trainer's per-rollout figures in the listing (verl: joined from the trainer).
ROLLOUT_COLUMNS = ("logprob_diff_mean", "logprob_diff_max", "importance_ratio")
#: The listing columns a report reads (a caller may hand it only these).
LISTING_COLUMNS = [*ROW_KEYS, *KEY_STR.values(), *ROLLOUT_COLUMNS]
#: What the per-rollout figures are, said beside them.
PER_ROLLOUT = (
    "per rollout, not per token: the trainer's figures of each rollout (the listing's "
    "logprob_diff_mean, logprob_diff_max, importance_ratio), no per-token trainer log-probs recorded"
)


@dataclass
class Report:
    """What the mismatch numbers say about a selection of a run.

    ``steps``: one dict per step and split (``step``, ``validate``, ``per``, every metric,
    ``verdict``, ``tokens_not_finite``: model tokens left out for a non-finite log-prob or
    difference, ``lengths_differ``: responses left out whose arrays are not one per token);
    ``buckets``: with ``by`` other than step, one dict per bucket (``by``, ``bucket``, the metrics);
    ``trend``: over the training steps; ``worst_rollouts`` and ``worst_tokens``: the largest |Δ|.
    ``per``: "token", or "rollout" (the trainer's per-rollout figures: ``metrics.rollout_metrics``;
    no tokens, no verdict; ``how`` says how to record per-token ones).
    """

    by: str
    counts: Counts
    steps: list[dict[str, Any]]
    trend: m.Trend | None
    buckets: list[dict[str, Any]] | None
    worst_rollouts: list[dict[str, Any]]
    worst_tokens: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    #: per row of the listing the report was made for: its response's largest |Δ| (NaN: none)
    largest_gaps: Any = None
    per: str = "token"
    how: str | None = None

    def verdicts(self) -> dict[tuple[Any, bool], str | None]:
        return {(r["step"], r["validate"]): r["verdict"] for r in self.steps}


def compute(
    run: Any,
    listing: Any,
    by: str = "step",
    top: int | None = WORST,
    decoder: Any = None,
    fields: Any = None,
    token_ids: bool = True,
    investigate: float = m.INVESTIGATE,
    broken: float = m.BROKEN,
    pieces: Iterable[Piece] | None = None,
    counts: Counts | None = None,
) -> Report:
    """The report over the trajectories of ``listing`` (rows of ``run.trajectories()``): per step
    and split, and by ``by`` (``metrics.BY``); ``top`` bucket rows for ``token`` and ``rollout``
    (None: all); ``decoder`` decodes the tokens of ``by="token"`` and the worst tokens; without
    ``token_ids`` the ids are not read (the worst tokens' are -1; ``by="token"`` reads them);
    ``investigate`` and ``broken``: the verdicts' thresholds on token_mult_prob_error.

    ``pieces`` and ``counts``: what :func:`digest` made of the listing's steps elsewhere (parts
    of the run, their pieces in step order, rows numbered in ``listing``); by default the steps
    are digested here, one at a time. Either way the same pieces fold in the same order.

    Without the trainer's per-token log-probs in any selected trajectory: the trainer's
    per-rollout figures (:func:`per_rollout`) where the listing has them, else
    ``NothingToCompare`` (the message says how to record them); ``RunError`` when nothing is
    selected."""
    if by not in BY:
        raise SelectionError(f"--by {by!r}: one of {', '.join(BY)}")
    if fields is None:
        from rlreplay.adapters.registry import adapter_for_run

        fields = getattr(adapter_for_run(run), "fields", None)
    limits = (investigate, broken)
    if pieces is None:
        counts = Counts()
        pieces = digest(run, listing, by, fields, counts, token_ids, limits)
    elif counts is None:
        raise ValueError("pieces made apart come with their counts")
    acc = _Accumulator(by, listing, limits)
    for piece in pieces:
        acc.fold(piece)
    how = (
        HOW_TO_RECORD_CALLS
        if getattr(fields, "response_in", None) == RESPONSE_IN_CALLS
        else HOW_TO_RECORD_SHORT
    )
    if not counts.compared:
        return _without_tokens(run, listing, counts, by, how)
    steps = acc.step_rows(counts)
    trained = [r for r in steps if not r["validate"] and isinstance(r["step"], int)]
    trend = m.trend(TREND_METRIC, [r["step"] for r in trained], [r[TREND_METRIC] for r in trained])
    notes = _notes(counts, sum(r["tokens_not_finite"] for r in steps))
    buckets = None if by == "step" else acc.bucket_rows(top, decoder, notes)
    worst_tokens = acc.worst_token_rows(decoder)
    largest = np.full(listing.num_rows, np.nan)
    largest[acc.all_rows()] = acc.sums()["max_abs"]
    return Report(by, counts, steps, trend, buckets, acc.worst_rollout_rows(), worst_tokens, notes, largest)


def _without_tokens(run: Any, listing: Any, counts: Counts, by: str, how: str) -> Report:
    """The per-rollout report where no selected trajectory has per-token trainer log-probs."""
    where = getattr(run, "address", run)
    if not counts.selected:
        raise RunError(f"no trajectories selected in {where}")
    report = per_rollout(listing, counts, how)
    if not report.steps:
        raise NothingToCompare(_nothing_to_compare(where, counts), how)
    if by != "step":
        report.by, report.buckets = by, []
        report.notes.append(f"by {by}: needs the trainer's per-token log-probs")
    return report


def _floats(column: Any) -> Any:
    """A listing column as float64 (NaN where null)."""
    return ops.fill_null(column, float("nan")).to_numpy(zero_copy_only=False).astype(np.float64)


def per_rollout(listing: Any, counts: Counts | None = None, how: str = HOW_TO_RECORD_SHORT) -> Report:
    """The report of the trainer's per-rollout figures in ``listing`` (``ROLLOUT_COLUMNS``), per
    step and split (``metrics.rollout_metrics``): for a run recorded without per-token trainer
    log-probs. Steps without a finite figure have no row; no row at all: nothing recorded."""
    import pyarrow as pa

    present = [c for c in ROLLOUT_COLUMNS if c in listing.column_names]
    values = {
        c: _floats(listing[c]) if c in present else np.full(listing.num_rows, np.nan) for c in ROLLOUT_COLUMNS
    }
    recorded = np.zeros(listing.num_rows, dtype=bool)
    for c in present:
        recorded |= ops.is_valid(listing[c]).to_numpy(zero_copy_only=False)
    with np.errstate(all="ignore"):
        finite = np.isfinite(values["logprob_diff_mean"]) | np.isfinite(values["logprob_diff_max"])
        finite |= np.isfinite(
            np.log(np.where(values["importance_ratio"] > 0, values["importance_ratio"], np.nan))
        )
    validate = ops.fill_null(listing["validate"], False).to_numpy(zero_copy_only=False)
    steps = []
    for step, rows in by_step(listing).items():
        for split in (False, True):
            chosen = rows[validate[rows] == split]
            if not len(chosen) or not finite[chosen].any():
                continue
            row: dict[str, Any] = {"step": step, "validate": split, "per": "rollout"}
            row.update(m.rollout_metrics(*(values[c][chosen] for c in ROLLOUT_COLUMNS)))
            row.update(
                verdict=None,
                tokens_not_finite=None,
                lengths_differ=0,
                rollouts_not_finite=int(np.count_nonzero(recorded[chosen] & ~finite[chosen])),
            )
            steps.append(row)
    steps.sort(key=lambda r: (key_order(r["step"]), r["validate"]))
    counts = counts if counts is not None else Counts(selected=listing.num_rows)
    trained = [r for r in steps if not r["validate"] and isinstance(r["step"], int)]
    trend = m.trend(
        ROLLOUT_TREND_METRIC, [r["step"] for r in trained], [r[ROLLOUT_TREND_METRIC] for r in trained]
    )
    notes = []
    shown = int(np.count_nonzero(finite))
    if shown < listing.num_rows:
        without = ~finite
        why = " (validation: verl computes none there)" if validate[without].all() else ""
        notes.append(
            f"{listing.num_rows - shown} of {listing.num_rows} selected trajectories have no "
            f"per-rollout figures{why}"
        )
    not_finite = int(np.count_nonzero(recorded & ~finite))
    if not_finite:
        notes.append(f"{not_finite} of them recorded figures that are not finite (NaN or ±inf): left out")
    largest = values["logprob_diff_max"]
    order = np.argsort(-np.where(np.isfinite(largest), largest, -np.inf), kind="stable")
    order = order[: min(WORST, int(np.count_nonzero(np.isfinite(largest))))]
    names = [c for c in listing.column_names if c.split("_str")[0] in ROW_KEYS]
    worst = []
    for i, found in zip(order, listing_rows(ops.take(listing.select(names), pa.array(order, pa.int64())))):
        row = {k: found.get(k) for k in ROW_KEYS}
        row.update(dict.fromkeys(m.METRICS), tokens=None)
        row.update(
            logprob_diff_mean=_finite(values["logprob_diff_mean"][i]),
            logprob_diff_max=_finite(largest[i]),
            importance_ratio=_finite(values["importance_ratio"][i]),
        )
        worst.append(row)
    return Report("step", counts, steps, trend, None, worst, [], notes, largest, per="rollout", how=how)


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if np.isfinite(value) else None


#: Training trajectories looked at to tell whether a run keeps the trainer's per-token log-probs.
SAMPLED = 8


def has_trainer_logprobs(run: Any, listing: Any, fields: Any = None) -> bool:
    """Whether the run keeps the trainer's per-token log-probs (a run-wide setting: ``record
    --token-signals``), told by a few training trajectories of the listing's first step that
    has them: their signals spans alone are read."""
    import pyarrow as pa

    from rlreplay.format.kinds import KIND_SIGNALS
    from rlreplay.mismatch.tokens import by_step, trainer_values
    from rlreplay.read.filters import Filters

    train = ops.invert(ops.fill_null(listing["validate"], False))
    if "advantage" in listing.column_names:  # a signals span was merged into these
        signed = ops.or_(ops.is_valid(listing["advantage"]), ops.is_valid(listing["logprob_diff_max"]))
        if ops.sum(ops.and_(train, signed)).as_py():
            train = ops.and_(train, signed)
    chosen = ops.filter(listing, train)
    for step, rows in by_step(chosen).items():
        ids = ops.take(chosen["id"], pa.array(rows[:SAMPLED], pa.int64())).to_pylist()
        filters = Filters(step=step) if type(step) is int else None
        loaded = run.load(ids, filters, kinds=(KIND_SIGNALS,))
        return any(trainer_values(s.output) is not None for t in loaded for s in t.spans)
    return False


def _nothing_to_compare(where: Any, counts: Counts) -> str:
    """Why nothing could be compared, in one line."""
    why = []
    if counts.no_rollout:
        why.append(f"{counts.no_rollout} without rollout log-probs per token")
    if counts.lengths_differ:
        why.append(f"{counts.lengths_differ} whose lengths differ ({counts.lengths_example})")
    if counts.no_trainer_validation and counts.no_trainer_validation == counts.no_trainer:
        why.append("validation: verl computes no trainer log-probs there")
    said = f" ({'; '.join(why)})" if why else ""
    return (
        f"nothing to compare: no trainer log-probs per token or per rollout in the {counts.selected} "
        f"selected trajectories of {where}{said}"
    )


def _notes(counts: Counts, not_finite: int = 0) -> list[str]:
    notes = []
    if counts.lengths_differ:
        notes.append(
            f"{counts.lengths_differ} of {counts.selected} selected trajectories are left out because "
            f"lengths differ (e.g. {counts.lengths_example}): never cut or padded"
        )
    if not_finite:
        notes.append(
            f"{not_finite} model tokens left out: a log-prob or their difference is not finite (NaN or ±inf)"
        )
    if counts.no_trainer:
        why = (
            " (validation: verl computes no trainer log-probs there)" if counts.no_trainer_validation else ""
        )
        notes.append(
            f"{counts.no_trainer} of {counts.selected} selected trajectories have no trainer log-probs "
            f"per token and are left out{why}"
        )
    if counts.no_rollout:
        notes.append(
            f"{counts.no_rollout} of {counts.selected} selected trajectories have no rollout "
            "log-probs per token and are left out"
        )
    if counts.issues:
        more = f" (+{len(counts.issues) - 1} more)" if len(counts.issues) > 1 else ""
        notes.append(f"unreadable payloads: {counts.issues[0]}{more}")
    return notes


def digest(
    run: Any,
    listing: Any,
    by: str,
    fields: Any,
    counts: Counts,
    token_ids: bool = True,
    limits: tuple[float, float] = (m.INVESTIGATE, m.BROKEN),
    keep: int | None = None,
) -> Iterator[Piece]:
    """The listing's steps, one :class:`Piece` each (read a step at a time: memory holds one
    step's tokens); ``counts`` is told what was left out and why. ``keep``: None when each step
    is whole in the listing, else the listing is a piece of its step and each split keeps at
    least ``keep`` of its largest |Δ| (``metrics.Tail.of``)."""
    acc = _Accumulator(by, listing, limits, keep)
    for batch in read_batches(run, listing, fields, counts, ids=token_ids or by == "token"):
        piece = acc.piece(batch)
        del batch
        ops.release_unused()  # what the step's read freed: memory stays one step's
        yield piece


@dataclass
class Piece:
    """What some responses of one step (all of them, or a piece cut between samples) add to a
    report, small beside their tokens: per response its listing row number, split and sums; per
    split the tail of its |Δ| (``metrics.Tail``) and its tokens left out; per response and token
    bucket its sums (``metrics.Buckets.partials``); its largest |Δ| (largest first, ``response``
    numbered in the piece). The step's figures are made when its pieces are all folded, from
    every response's sums in order: folding a run's pieces in order gives the same report however
    the steps were cut."""

    rows: Any
    sums: dict[str, Any]
    version: Any
    step: Any
    validate: Any
    splits: dict[bool, tuple[m.Tail, int]]
    buckets: list[tuple[str, Any, Any]]
    worst: list[tuple[float, dict[str, Any]]]


class _Accumulator:
    """What the report keeps while the steps go by: per response its listing row number and sums,
    per token bucket its sums, the worst tokens; per step and split its numbers."""

    def __init__(self, by: str, listing: Any, limits: tuple[float, float], keep: int | None = None) -> None:
        self.by = by
        self.listing = listing
        self.limits = limits
        self.keep = keep
        self.open: list[Piece] = []  # the pieces folded of the step not yet closed
        self.rows: list[Any] = []  # per batch: its responses' listing row numbers
        self.parts: Any = []  # per batch: per-response sums (then, all of them: ``sums``)
        self.versions: list[Any] = []
        self.step_metrics: list[dict[str, Any]] = []
        self.buckets = m.Buckets()  # per token bucket: TOKEN_SUMS
        self.worst: list[tuple[float, int, dict[str, Any]]] = []  # a min-heap of the largest |Δ|
        self.seen = 0
        self.count = 0

    def add(self, batch: Batch) -> None:
        self.fold(self.piece(batch))

    def piece(self, batch: Batch) -> Piece:
        """What ``batch`` (one step's responses, or some of them) adds (see :class:`Piece`)."""
        counted = batch.counted
        key = self.token_key(batch, counted) if self.by in m.TOKEN_KEYS else None
        keep = None if key is None or (key >= 0).all() else key >= 0  # per counted token
        gaps: list[Any] = []
        buckets: list[tuple[str, Any, Any]] = []
        groups: dict[str, Any] = {}
        if key is not None:
            running = np.r_[0, np.cumsum(counted, dtype=np.int64)]
            per = running[batch.offsets[1:]] - running[batch.offsets[:-1]]
            response = np.repeat(np.arange(len(per)), per)  # each counted token's response
            del running

        def each(name: str, values: Any, at: slice) -> None:
            if name == "max_abs":
                gaps.append(values)
            if key is None:
                return
            if groups.get("at") != (at.start, at.stop):  # one grouping a chunk of whole responses
                chosen = slice(None) if keep is None else keep[at]
                groups.update(at=(at.start, at.stop), chosen=chosen)
                groups.update(
                    zip(("bucket", "inverse"), m.Buckets.groups(response[at][chosen], key[at][chosen]))
                )
            chosen = groups["chosen"]
            reduced = m.Buckets.partials(groups["inverse"], len(groups["bucket"]), name, values[chosen])
            buckets.append((name, groups["bucket"], reduced))

        sums = m.sequence_sums(batch, counted, each)
        left_out = batch.mask & ~counted  # model tokens whose log-prob difference is not finite
        gap = np.concatenate(gaps) if len(gaps) != 1 else gaps[0]
        step = self.listing_row(int(batch.rows[0]))["step"]
        splits: dict[bool, tuple[m.Tail, int]] = {}
        for split in (False, True):
            chosen = batch.validate == split
            if not chosen.any():
                continue
            if chosen.all():  # the usual case: one split a step, no copy
                splits[split] = (m.Tail.of(gap, self.keep), int(np.count_nonzero(left_out)))
                continue
            of_split = np.repeat(chosen, np.diff(batch.offsets))
            tail = m.Tail.of(gap[of_split[counted]], self.keep)
            splits[split] = (tail, int(np.count_nonzero(left_out & of_split)))
        worst = self.worst_of(batch, counted, gap)
        return Piece(batch.rows, sums, batch.version, step, batch.validate, splits, buckets, worst)

    def fold(self, piece: Piece) -> None:
        """Add what some responses of a step add (:meth:`piece`), after the pieces folded so
        far; a piece of another step closes the step before (:meth:`close`)."""
        if self.open and not same_step(self.open[-1].step, piece.step):
            self.close()
        base = self.count
        self.count += len(piece.rows)
        self.rows.append(piece.rows)
        self.parts.append(piece.sums)
        self.versions.append(piece.version)
        for name, bucket, reduced in piece.buckets:
            self.buckets.fold(name, bucket, reduced)
        self.add_worst(piece.worst, base)
        self.open.append(piece)

    def close(self) -> None:
        """The figures of the step whose pieces are folded, per split, from its responses' sums
        in order (as one piece of the whole step would give them)."""
        pieces, self.open = self.open, []
        if not pieces:
            return
        sums = {name: np.concatenate([p.sums[name] for p in pieces]) for name in m.SUMS}
        validate = np.concatenate([p.validate for p in pieces])
        for split in (False, True):
            chosen = np.flatnonzero(validate == split)
            if not len(chosen):
                continue
            held = [p.splits[split] for p in pieces if split in p.splits]
            tail = m.Tail.merged([t for t, _ in held])
            if tail is None:
                raise ValueError("a piece of a step kept too few of its largest |Δ| (ask it for more)")
            part = m.take(sums, chosen)
            row = {"step": pieces[0].step, "validate": split, "per": "token"}
            row.update(m.summarize(m.totals_of(part), part, tail))
            row["verdict"] = m.verdict(row["token_mult_prob_error"], *self.limits)
            row["tokens_not_finite"] = sum(k for _, k in held)
            self.step_metrics.append(row)

    def token_key(self, batch: Batch, counted: Any) -> Any:
        """Each counted token's bucket (an int ≥ 0; -1: none), or None when the run has no data."""
        if self.by == "position":
            return m.position_bucket(batch.position[counted])
        if self.by == "probability":
            return m.probability_bucket(batch.rollout[counted])
        if self.by == "turn":
            return batch.turn[counted]
        if self.by == "token":
            return batch.ids[counted]
        if self.by == "entropy":
            if batch.entropy is None:
                return None
            entropy = batch.entropy[counted]
            known = np.isfinite(entropy)
            return np.where(known, m.entropy_bucket(np.where(known, entropy, 0.0)), -1)
        raise AssertionError(self.by)

    @staticmethod
    def worst_of(batch: Batch, counted: Any, gaps: Any) -> list[tuple[float, dict[str, Any]]]:
        """The batch's ``WORST`` largest |Δ| (``gaps``: of its counted tokens), largest first."""
        if not len(gaps):
            return []
        k = min(WORST, len(gaps))
        kth = gaps[np.argpartition(-gaps, k - 1)[k - 1]]
        above = np.flatnonzero(gaps > kth)  # ties at the k-th: the first tokens (as in any piece)
        top = np.sort(np.r_[above, np.flatnonzero(gaps == kth)[: k - len(above)]])
        where = np.flatnonzero(counted)
        out = []
        for i in top[np.argsort(-gaps[top], kind="stable")]:
            at = int(where[i])
            seq = int(np.searchsorted(batch.offsets, at, side="right")) - 1
            item = {
                "response": seq,
                "position": at - int(batch.offsets[seq]),
                "token_id": int(batch.ids[at]) if batch.ids is not None else -1,
                "rollout": float(batch.rollout[at]),
                "trainer": float(batch.trainer[at]),
                "logprob_diff": float(gaps[i]),
            }
            out.append((float(gaps[i]), item))
        return out

    def add_worst(self, candidates: list[tuple[float, dict[str, Any]]], base: int) -> None:
        """Keep the largest |Δ| seen so far (``candidates``: a step's, largest first; their
        ``response`` numbered from ``base``)."""
        floor = self.worst[0][0] if len(self.worst) >= WORST else -np.inf
        for gap, found in candidates:
            if gap <= floor:
                break
            self.seen += 1
            item = {**found, "response": base + found["response"]}
            entry = (gap, -self.seen, item)
            if len(self.worst) < WORST:
                heapq.heappush(self.worst, entry)
            else:
                heapq.heappushpop(self.worst, entry)
            floor = self.worst[0][0] if len(self.worst) >= WORST else -np.inf

    # ---- results ------------------------------------------------------------------------------

    def sums(self) -> dict[str, Any]:
        """Every response's sums, in the report's order (made once, when the steps are done)."""
        if self.parts and not isinstance(self.parts, dict):
            self.parts = {name: np.concatenate([p[name] for p in self.parts]) for name in m.SUMS}
        return self.parts if self.parts else {name: np.zeros(0) for name in m.SUMS}

    def all_rows(self) -> Any:
        return np.concatenate(self.rows)

    def step_rows(self, counts: Counts | None = None) -> list[dict[str, Any]]:
        """Per step and split, its numbers and what was left out; a step and split of which
        every response was left out for lengths that differ has a row of its own (no numbers)."""
        self.close()
        differ = dict(counts.lengths_differ_at) if counts is not None else {}
        rows = []
        for row in self.step_metrics:
            rows.append({**row, "lengths_differ": differ.pop((row["step"], row["validate"]), 0)})
        for (step, split), k in differ.items():
            empty = {**dict.fromkeys(m.METRICS), "sequences": 0, "tokens": 0}
            rows.append(
                {"step": step, "validate": split, "per": "token", **empty, "verdict": None}
                | {"tokens_not_finite": 0, "lengths_differ": k}
            )
        return sorted(rows, key=lambda r: (key_order(r["step"]), r["validate"]))

    def listing_row(self, row: int) -> dict[str, Any]:
        """Listing row ``row`` (a number), as ``ROW_KEYS``."""
        import pyarrow as pa

        names = [c for c in self.listing.column_names if c.split("_str")[0] in ROW_KEYS]
        found = listing_rows(ops.take(self.listing.select(names), pa.array([row], pa.int64())))[0]
        return {k: found.get(k) for k in ROW_KEYS}

    def response_rows(self, responses: Any, sums: dict[str, Any]) -> list[dict[str, Any]]:
        """Responses (numbers in the report's order) as rows: who they are and their numbers."""
        rows = self.all_rows()
        out = []
        for i in responses:
            row = self.listing_row(int(rows[i]))
            row.update(m.summarize(m.totals_of(sums, [i]), m.take(sums, [i])))
            out.append(row)
        return out

    def worst_rollout_rows(self) -> list[dict[str, Any]]:
        sums = self.sums()
        return self.response_rows(self.largest(sums, WORST), sums)

    @staticmethod
    def largest(sums: dict[str, Any], top: int | None) -> Any:
        """The responses with a counted token, the largest |Δ| first (``top`` of them)."""
        largest = sums["max_abs"]
        order = np.argsort(-np.nan_to_num(largest, nan=-1.0), kind="stable")
        order = order[: np.count_nonzero(~np.isnan(largest))]
        return order[:top] if top else order

    def worst_token_rows(self, decoder: Any) -> list[dict[str, Any]]:
        items = [item for _, _, item in sorted(self.worst, key=lambda e: (-e[0], -e[1]))]
        texts = _texts(decoder, [item["token_id"] for item in items])
        rows = self.all_rows()
        out = []
        for item, text in zip(items, texts):
            row = self.listing_row(int(rows[item["response"]]))
            row.update({k: v for k, v in item.items() if k != "response"}, text=text)
            out.append(row)
        return out

    def bucket_rows(self, top: int | None, decoder: Any, notes: list[str]) -> list[dict[str, Any]]:
        if self.by in m.TOKEN_KEYS:
            return self.token_bucket_rows(top, decoder, notes)
        sums = self.sums()
        if self.by == "rollout":
            return [
                {"by": "rollout", "bucket": row["id"], **row}
                for row in self.response_rows(self.largest(sums, top), sums)
            ]
        keys, labels, skipped = self.sequence_keys()
        if skipped:
            notes.append(skipped)
        order = np.argsort(keys, kind="stable")
        order = order[keys[order] >= 0]
        cuts = np.searchsorted(keys[order], np.arange(len(labels) + 1))
        out = []
        for k, label in enumerate(labels):
            members = order[cuts[k] : cuts[k + 1]]
            if not len(members):
                continue
            part = m.take(sums, members)
            out.append({"by": self.by, "bucket": label, **m.summarize(m.totals_of(part), part)})
        return sorted(out, key=lambda r: key_order(r["bucket"]))

    def sequence_keys(self) -> tuple[Any, list[Any], str | None]:
        """Each response's bucket (an int; -1: no data) and the buckets' labels, and a note on
        the responses without one."""
        import pyarrow as pa

        rows = pa.array(self.all_rows(), pa.int64())
        if self.by == "worker":
            coded = ops.dictionary_encode(ops.take(self.listing["worker"], rows)).combine_chunks()
            keys = ops.fill_null(coded.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
            return keys, coded.dictionary.to_pylist(), None
        versions = np.concatenate(self.versions) if self.versions else np.zeros(0)
        known = ~np.isnan(versions)
        values = np.where(known, versions, 0).astype(np.int64)
        what = "weights version (verl: the agent output's extra_fields.max_global_steps)"
        if self.by == "staleness":
            steps = ops.take(self.listing["step"], rows)
            known &= ops.is_valid(steps).to_numpy(zero_copy_only=False)
            values = ops.fill_null(steps, 0).to_numpy(zero_copy_only=False) - 1 - values
            what = (
                "weights version and an integer step (staleness = step − 1 − version, verl's "
                "trajectory_staleness)"
            )
        labels, inverse = np.unique(values[known], return_inverse=True)
        keys = np.full(len(values), -1, dtype=np.int64)
        keys[known] = inverse
        missing = int(np.count_nonzero(~known))
        note = f"{missing} of {len(keys)} responses recorded no {what}: left out" if missing else None
        return keys, [int(v) for v in labels], note

    def token_bucket_rows(self, top: int | None, decoder: Any, notes: list[str]) -> list[dict[str, Any]]:
        sums = self.buckets.padded() if self.buckets.size() else None
        if sums is None or not int(sums["tokens"].sum()):
            if self.by == "entropy":
                notes.append("no entropy was recorded per token in these responses: nothing to bucket by")
            return []
        present = np.flatnonzero(sums["tokens"] > 0)
        if self.by == "token":
            chosen = present[np.argsort(-sums["sum_abs"][present], kind="stable")]
            chosen = chosen[:top] if top else chosen
            texts = _texts(decoder, [int(i) for i in chosen])
        else:  # every bucket in range, those without tokens said so
            chosen = np.arange(int(present.max()) + 1)
            if self.by == "probability":
                chosen = np.arange(m.PROBABILITY_BUCKETS)
            elif self.by == "turn":  # a counted token is a model token: in turn 1 or later
                chosen = chosen[1:]
            texts = [None] * len(chosen)
        label: Callable[[int], Any] = {
            "position": m.position_label,
            "probability": m.probability_label,
            "entropy": m.entropy_label,
        }.get(self.by, int)
        out = []
        for i, text in zip(chosen, texts):
            i = int(i)
            row: dict[str, Any] = {"by": self.by, "bucket": label(i)}
            part = m.totals_of(sums, [i]) if i < len(sums["tokens"]) else dict.fromkeys(m.TOKEN_SUMS, 0.0)
            row.update(m.summarize(part))
            if self.by == "token":
                row.update(logprob_diff_sum=float(sums["sum_abs"][i]), text=text)
            out.append(row)
        return out


def kept_too_few(pieces: list[Piece]) -> int:
    """0 when the pieces of one step (all of them) kept the largest |Δ| their step's percentiles
    read, else how many of its largest each piece must keep (``digest``'s ``keep``)."""
    need = 0
    for split in (False, True):
        tails = [p.splits[split][0] for p in pieces if split in p.splits]
        if tails and m.Tail.merged(tails) is None:
            need = max(need, m.top_needed(sum(t.count for t in tails)))
    return need


def same_step(a: Any, b: Any) -> bool:
    """Whether two pieces' steps are one (an integer step and a step recorded as text never are)."""
    return type(a) is type(b) and a == b


def _texts(decoder: Any, ids: list[int]) -> list[str | None]:
    """Each token id decoded alone (None without a decoder, or for an id not recorded)."""
    if decoder is None or not ids:
        return [None] * len(ids)
    known = [i for i in ids if i >= 0]
    texts = dict(zip(known, decoder.decode_many([[i] for i in known]))) if known else {}
    return [texts.get(i) for i in ids]
