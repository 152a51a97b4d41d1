"""The mismatch report of a selection of a run: per step and split, by a bucket key, the trend, and
the worst responses and tokens. ``rlreplay mismatch``, the audit's ``mismatch`` check and the
UI's mismatch page all show what :func:`compute` returns.

The run is read a step at a time (``rlreplay.mismatch.tokens.read_batches``): memory holds one
step's tokens, a few sums per response and per bucket, and the worst tokens seen so far.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlreplay.errors import RunError, SelectionError
from rlreplay.format import arrow_ops as ops
from rlreplay.format.keys import KEY_STR, KEYS, key_order
from rlreplay.mismatch import BY
from rlreplay.mismatch import metrics as m
from rlreplay.mismatch.tokens import HOW_TO_RECORD, Batch, Counts, read_batches
from rlreplay.model import listing_rows

#: Worst responses and tokens a report keeps.
WORST = 20
#: The metric the trend is drawn from.
TREND_METRIC = "logprob_diff_mean"
#: What a response is known by in a report's rows.
ROW_KEYS = ("id", *KEYS, "validate", "worker")
#: The listing columns a report reads (a caller may hand it only these).
LISTING_COLUMNS = [*ROW_KEYS, *KEY_STR.values()]


@dataclass
class Report:
    """What the mismatch numbers say about a selection of a run.

    ``steps``: one dict per step and split (``step``, ``validate``, every metric, ``verdict``);
    ``buckets``: with ``by`` other than step, one dict per bucket (``by``, ``bucket``, the metrics);
    ``trend``: over the training steps; ``worst_rollouts`` and ``worst_tokens``: the largest |Δ|.
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

    Raises ``RunError`` when no selected trajectory has both the rollout's and the trainer's
    per-token log-probs (the message says how to record them)."""
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
    if not counts.compared:
        raise RunError(_nothing_to_compare(run, counts))
    steps = acc.step_rows()
    trained = [r for r in steps if not r["validate"] and isinstance(r["step"], int)]
    trend = m.trend(TREND_METRIC, [r["step"] for r in trained], [r[TREND_METRIC] for r in trained])
    notes = _notes(counts)
    buckets = None if by == "step" else acc.bucket_rows(top, decoder, notes)
    worst_tokens = acc.worst_token_rows(decoder)
    largest = np.full(listing.num_rows, np.nan)
    largest[acc.all_rows()] = acc.sums()["max_abs"]
    return Report(by, counts, steps, trend, buckets, acc.worst_rollout_rows(), worst_tokens, notes, largest)


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


def _nothing_to_compare(run: Any, counts: Counts) -> str:
    where = getattr(run, "address", run)
    if not counts.selected:
        return f"no trajectories selected in {where}"
    if counts.compared == 0 and counts.no_trainer == 0:
        return (
            f"none of the {counts.selected} selected trajectories in {where} has the rollout's "
            f"log-probs per token (an agent span's response_logprobs, or its model calls' log_probs); "
            f"{HOW_TO_RECORD}"
        )
    return (
        f"no trainer log-probs per token in the {counts.selected} selected trajectories of {where}: "
        f"{HOW_TO_RECORD}"
    )


def _notes(counts: Counts) -> list[str]:
    notes = []
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
) -> Iterator[Piece]:
    """The listing's steps, one :class:`Piece` each (read a step at a time: memory holds one
    step's tokens); ``counts`` is told what was left out and why."""
    acc = _Accumulator(by, listing, limits)
    for batch in read_batches(run, listing, fields, counts, ids=token_ids or by == "token"):
        piece = acc.piece(batch)
        del batch
        ops.release_unused()  # what the step's read freed: memory stays one step's
        yield piece


@dataclass
class Piece:
    """What one step's responses add to a report, small beside their tokens: per response its
    listing row number and sums, the step's rows (per split), its token buckets' sums (in the
    order they are added) and its largest |Δ| (largest first, ``response`` numbered in the step).
    Folding the pieces of a run's steps in order gives the report, however they were made."""

    rows: Any
    sums: dict[str, Any]
    version: Any
    step_metrics: list[dict[str, Any]]
    buckets: list[tuple[str, Any]]
    worst: list[tuple[float, dict[str, Any]]]


class _Accumulator:
    """What the report keeps while the steps go by: per response its listing row number and sums,
    per token bucket its sums, the worst tokens; per step and split its numbers."""

    def __init__(self, by: str, listing: Any, limits: tuple[float, float]) -> None:
        self.by = by
        self.listing = listing
        self.limits = limits
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
        """What ``batch`` adds (see :class:`Piece`)."""
        counted = batch.counted
        key = self.token_key(batch, counted) if self.by in m.TOKEN_KEYS else None
        keep = None if key is None or (key >= 0).all() else key >= 0  # per counted token
        gaps: list[Any] = []
        buckets: list[tuple[str, Any]] = []

        def each(name: str, values: Any, at: slice) -> None:
            if name == "max_abs":
                gaps.append(values)
            if key is not None:
                if keep is None:
                    buckets.append((name, m.Buckets.reduce(key[at], name, values)))
                else:
                    buckets.append((name, m.Buckets.reduce(key[at][keep[at]], name, values[keep[at]])))

        sums = m.sequence_sums(batch, counted, each)
        gap = np.concatenate(gaps) if len(gaps) != 1 else gaps[0]
        step = self.listing_row(int(batch.rows[0]))["step"]
        rows = []
        for split in (False, True):
            chosen = np.flatnonzero(batch.validate == split)
            if not len(chosen):
                continue
            part = m.take(sums, chosen)
            if len(chosen) == len(batch.validate):  # the usual case: one split a step, no copy
                gaps_of_split = gap
            else:
                gaps_of_split = gap[np.repeat(batch.validate == split, np.diff(batch.offsets))[counted]]
            row = {"step": step, "validate": split}
            row.update(m.summarize(m.totals_of(part), part, gaps_of_split))
            row["verdict"] = m.verdict(row["token_mult_prob_error"], *self.limits)
            rows.append(row)
        worst = self.worst_of(batch, counted, gap)
        return Piece(batch.rows, sums, batch.version, rows, buckets, worst)

    def fold(self, piece: Piece) -> None:
        """Add what one step's responses add (:meth:`piece`), after the steps folded so far."""
        base = self.count
        self.count += len(piece.rows)
        self.rows.append(piece.rows)
        self.parts.append(piece.sums)
        self.versions.append(piece.version)
        self.step_metrics.extend(piece.step_metrics)
        for name, reduced in piece.buckets:
            self.buckets.fold(name, reduced)
        self.add_worst(piece.worst, base)

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
        top = np.argpartition(-gaps, k - 1)[:k]
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

    def step_rows(self) -> list[dict[str, Any]]:
        return sorted(self.step_metrics, key=lambda r: (key_order(r["step"]), r["validate"]))

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


def _texts(decoder: Any, ids: list[int]) -> list[str | None]:
    """Each token id decoded alone (None without a decoder, or for an id not recorded)."""
    if decoder is None or not ids:
        return [None] * len(ids)
    known = [i for i in ids if i >= 0]
    texts = dict(zip(known, decoder.decode_many([[i] for i in known]))) if known else {}
    return [texts.get(i) for i in ids]
