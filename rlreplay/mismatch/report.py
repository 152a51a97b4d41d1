"""The mismatch report of a selection of a run: per step and split, by a bucket key, the trend, and
the worst responses and tokens. ``rlreplay mismatch``, the audit's ``mismatch`` check and the
UI's mismatch page all show what :func:`compute` returns.

The run is read a step at a time (``rlreplay.mismatch.tokens.read_batches``): memory holds one
step's tokens, a few sums per response and per bucket, and the worst tokens seen so far.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlreplay.errors import RunError, SelectionError
from rlreplay.format.keys import key_order
from rlreplay.mismatch import BY
from rlreplay.mismatch import metrics as m
from rlreplay.mismatch.tokens import HOW_TO_RECORD, Batch, Counts, read_batches

#: Worst responses and tokens a report keeps.
WORST = 20
#: The metric the trend is drawn from.
TREND_METRIC = "logprob_diff_mean"
#: What a response is known by in a report's rows.
ROW_KEYS = ("id", "step", "sample_index", "rollout_n", "validate", "worker")


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

    def verdicts(self) -> dict[tuple[Any, bool], str | None]:
        return {(r["step"], r["validate"]): r["verdict"] for r in self.steps}


def compute(
    run: Any,
    listing: Any,
    by: str = "step",
    top: int | None = WORST,
    decoder: Any = None,
    fields: Any = None,
) -> Report:
    """The report over the trajectories of ``listing`` (rows of ``run.trajectories()``): per step
    and split, and by ``by`` (``metrics.BY``); ``top`` bucket rows for ``token`` and ``rollout``
    (None: all); ``decoder`` decodes the tokens of ``by="token"`` and the worst tokens.

    Raises ``RunError`` when no selected trajectory has both the rollout's and the trainer's
    per-token log-probs (the message says how to record them)."""
    if by not in BY:
        raise SelectionError(f"--by {by!r}: one of {', '.join(BY)}")
    if fields is None:
        from rlreplay.adapters.registry import adapter_for_run

        fields = getattr(adapter_for_run(run), "fields", None)
    counts = Counts()
    acc = _Accumulator(by)
    for batch in read_batches(run, listing, fields, counts):
        acc.add(batch)
    if not counts.compared:
        raise RunError(_nothing_to_compare(run, counts))
    steps = acc.step_rows()
    trained = [r for r in steps if not r["validate"] and isinstance(r["step"], int)]
    trend = m.trend(TREND_METRIC, [r["step"] for r in trained], [r[TREND_METRIC] for r in trained])
    notes = _notes(counts)
    buckets = None if by == "step" else acc.bucket_rows(top, decoder, notes)
    worst_tokens = acc.worst_token_rows(decoder)
    return Report(by, counts, steps, trend, buckets, acc.worst_rollout_rows(), worst_tokens, notes)


def _nothing_to_compare(run: Any, counts: Counts) -> str:
    where = getattr(run, "address", run)
    if not counts.selected:
        return f"no trajectories selected in {where}"
    if counts.compared == 0 and counts.no_trainer == 0:
        return (
            f"none of the {counts.selected} selected trajectories in {where} has an agent span with "
            f"the rollout's per-token log-probs (response_logprobs); {HOW_TO_RECORD}"
        )
    return (
        f"no per-token trainer log-probs in the {counts.selected} selected trajectories of {where}: "
        f"{HOW_TO_RECORD}"
    )


def _notes(counts: Counts) -> list[str]:
    notes = []
    if counts.no_trainer:
        why = (
            " (validation: verl computes no trainer log-probs there)" if counts.no_trainer_validation else ""
        )
        notes.append(
            f"{counts.no_trainer} of {counts.selected} selected trajectories have no per-token trainer "
            f"log-probs and are left out{why}"
        )
    if counts.no_rollout:
        notes.append(
            f"{counts.no_rollout} of {counts.selected} selected trajectories have no agent span with "
            "rollout log-probs and are left out"
        )
    if counts.issues:
        more = f" (+{len(counts.issues) - 1} more)" if len(counts.issues) > 1 else ""
        notes.append(f"unreadable payloads: {counts.issues[0]}{more}")
    return notes


class _Accumulator:
    """What the report keeps while the steps go by."""

    def __init__(self, by: str) -> None:
        self.by = by
        self.rows: list[dict[str, Any]] = []  # per response: its listing row
        self.parts: list[dict[str, Any]] = []  # per batch: per-response sums
        self.versions: list[Any] = []
        self.step_metrics: list[dict[str, Any]] = []
        self.tokens: dict[str, Any] | None = None  # per token bucket: TOKEN_SUMS
        self.token_counts: dict[int, int] = {}  # by="token": how often each id was sampled
        self.worst: list[tuple[float, int, dict[str, Any]]] = []  # a min-heap of the largest |Δ|
        self.seen = 0

    def add(self, batch: Batch) -> None:
        counted = batch.counted
        t = m.terms(batch.trainer[counted], batch.rollout[counted])
        sums = m.sequence_sums(batch, counted, t)
        base = len(self.rows)
        self.rows.extend(batch.rows)
        self.parts.append(sums)
        self.versions.append(batch.version)
        validate = np.array([bool(r["validate"]) for r in batch.rows], dtype=bool)
        token_split = np.repeat(validate, np.diff(batch.offsets))[counted]
        step = batch.rows[0]["step"]
        for split in (False, True):
            chosen = np.flatnonzero(validate == split)
            if not len(chosen):
                continue
            part = m.take(sums, chosen)
            row = {"step": step, "validate": split}
            row.update(m.summarize(m.totals_of(part), part, t["abs"][token_split == split]))
            row["verdict"] = m.verdict(row["token_mult_prob_error"])
            self.step_metrics.append(row)
        if self.by in m.TOKEN_KEYS:
            self.add_tokens(batch, counted, t)
        self.add_worst(batch, counted, t, base)

    def add_tokens(self, batch: Batch, counted: Any, t: dict[str, Any]) -> None:
        key = self.token_key(batch, counted)
        if key is None:
            return
        keep = key >= 0
        if not keep.all():
            key = key[keep]
            t = {k: v[keep] for k, v in t.items()}
        size = int(key.max()) + 1 if len(key) else 0
        if self.tokens is not None:
            size = max(size, len(self.tokens["tokens"]))
        sums = m.grouped_sums(key, size, t)
        if self.tokens is None:
            self.tokens = sums
            return
        for name, values in sums.items():
            old = self.tokens[name]
            if len(old) < size:
                fill = np.nan if name == "max_abs" else 0.0
                old = np.concatenate([old, np.full(size - len(old), fill)])
            if name == "max_abs":
                self.tokens[name] = np.fmax(old, values)
            else:
                self.tokens[name] = old + values

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

    def add_worst(self, batch: Batch, counted: Any, t: dict[str, Any], base: int) -> None:
        gaps = t["abs"]
        if not len(gaps):
            return
        k = min(WORST, len(gaps))
        floor = self.worst[0][0] if len(self.worst) >= WORST else -np.inf
        top = np.argpartition(-gaps, k - 1)[:k]
        where = np.flatnonzero(counted)
        seq, pos = batch.sequence, batch.position
        for i in top[np.argsort(-gaps[top], kind="stable")]:
            gap = float(gaps[i])
            if gap <= floor:
                break
            at = int(where[i])
            self.seen += 1
            item = {
                "response": base + int(seq[at]),
                "position": int(pos[at]),
                "token_id": int(batch.ids[at]),
                "rollout": float(batch.rollout[at]),
                "trainer": float(batch.trainer[at]),
                "logprob_diff": gap,
            }
            entry = (gap, -self.seen, item)
            if len(self.worst) < WORST:
                heapq.heappush(self.worst, entry)
            else:
                heapq.heappushpop(self.worst, entry)
            floor = self.worst[0][0] if len(self.worst) >= WORST else -np.inf

    # ---- results ------------------------------------------------------------------------------

    def sums(self) -> dict[str, Any]:
        return {name: np.concatenate([p[name] for p in self.parts]) for name in m.SUMS}

    def step_rows(self) -> list[dict[str, Any]]:
        return sorted(self.step_metrics, key=lambda r: (key_order(r["step"]), r["validate"]))

    def row_of(self, i: int) -> dict[str, Any]:
        return {k: self.rows[i][k] for k in ROW_KEYS}

    def worst_rollout_rows(self) -> list[dict[str, Any]]:
        sums = self.sums()
        largest = np.nan_to_num(sums["max_abs"], nan=-1.0)
        order = np.argsort(-largest, kind="stable")[:WORST]
        out = []
        for i in order:
            if largest[i] < 0:
                break
            row = self.row_of(int(i))
            row.update(m.summarize(m.totals_of(sums, [i]), m.take(sums, [i])))
            out.append(row)
        return out

    def worst_token_rows(self, decoder: Any) -> list[dict[str, Any]]:
        items = [item for _, _, item in sorted(self.worst, key=lambda e: (-e[0], -e[1]))]
        texts = _texts(decoder, [item["token_id"] for item in items])
        out = []
        for item, text in zip(items, texts):
            row = self.row_of(item["response"])
            row.update({k: v for k, v in item.items() if k != "response"}, text=text)
            out.append(row)
        return out

    def bucket_rows(self, top: int | None, decoder: Any, notes: list[str]) -> list[dict[str, Any]]:
        if self.by in m.TOKEN_KEYS:
            return self.token_bucket_rows(top, decoder, notes)
        sums = self.sums()
        keys, skipped = self.sequence_keys(sums)
        if skipped:
            notes.append(skipped)
        groups: dict[Any, list[int]] = {}
        for i, key in enumerate(keys):
            if key is not None:
                groups.setdefault(key, []).append(i)
        out = []
        for key, members in groups.items():
            rows = np.asarray(members)
            part = m.take(sums, rows)
            row: dict[str, Any] = {"by": self.by, "bucket": key}
            if self.by == "rollout":
                row.update(self.row_of(members[0]))
            row.update(m.summarize(m.totals_of(part), part))
            out.append(row)
        if self.by == "rollout":
            out.sort(key=lambda r: -(r["logprob_diff_max"] if r["logprob_diff_max"] is not None else -1.0))
            return out[:top] if top else out
        return sorted(out, key=lambda r: key_order(r["bucket"]))

    def sequence_keys(self, sums: dict[str, Any]) -> tuple[list[Any], str | None]:
        """Each response's bucket (None: no data), and a note on those without one."""
        if self.by == "worker":
            return [r["worker"] for r in self.rows], None
        if self.by == "rollout":
            return [r["id"] for r in self.rows], None
        versions = np.concatenate(self.versions) if self.versions else np.zeros(0)
        what = (
            "weights version (verl: the agent output's extra_fields.max_global_steps)"
            if self.by == "version"
            else "weights version and an integer step (staleness = step − 1 − version, verl's "
            "trajectory_staleness)"
        )
        keys: list[Any] = []
        for row, version in zip(self.rows, versions):
            if math.isnan(version):
                keys.append(None)
            elif self.by == "version":
                keys.append(int(version))
            else:
                keys.append(row["step"] - 1 - int(version) if isinstance(row["step"], int) else None)
        missing = sum(k is None for k in keys)
        note = f"{missing} of {len(keys)} responses recorded no {what}: left out" if missing else None
        return keys, note

    def token_bucket_rows(self, top: int | None, decoder: Any, notes: list[str]) -> list[dict[str, Any]]:
        sums = self.tokens
        if sums is None or not int(sums["tokens"].sum()):
            if self.by == "entropy":
                notes.append("no per-token entropy was recorded in these responses: nothing to bucket by")
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
