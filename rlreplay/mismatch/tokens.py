"""Each recorded response's tokens with the rollout's and the trainer's log-probs, and which count.

The rollout side is where the run's framework adapter says its response is (``fields.response_in``):
the agent span's response log-probs (verl: ``AgentLoopOutput.response_logprobs``) with its response
mask (``response_mask``: 1 = a token the model sampled, 0 = a tool or observation token); or the
model calls' generated ids and log-probs end to end, in call order, every token the model's (the
``llm`` spans of ``rlreplay proxy``). The trainer side is the ``signals`` span's ``old_log_probs``
(verl with ``rlreplay record --token-signals``; with the generic API, ``record_signals(...,
output={"old_log_probs": [...]})``), one per response token. A token *counts* when the mask says
the model sampled it and the difference of its two log-probs is a finite number (NaN, ±inf on
either side: left out, and counted as such): the one definition the mismatch numbers, the audit and
the UI overlay use. A response's arrays are one per response token: a response whose trainer's
(or rollout's, or mask's) values are more or fewer is left out whole and counted, never cut or
padded.

:func:`read_batches` reads a selection a step at a time (one pass over each step's files, the
token arrays as numpy, never as Python lists); :func:`of_trajectory` takes one loaded trajectory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from rlreplay.errors import NotExact
from rlreplay.format import arrow_ops as ops
from rlreplay.format.arrays import DTYPE_COLUMNS, Restorer
from rlreplay.format.kinds import KIND_AGENT, KIND_LLM, KIND_SIGNALS
from rlreplay.format.payload import TOKENS, decode_safe, from_json, unwrapped
from rlreplay.read.filters import Filters
from rlreplay.text.conversation import RESPONSE_IN_CALLS, ConversationFields

#: Where the trainer's per-token log-probs live in a ``signals`` span's output (verl: old_log_probs).
TRAINER_KEYS = ("old_log_probs", "trainer_log_probs", "log_probs", "logprobs")
#: Per-token entropy, where the agent span's output (or the signals span's) records it.
ENTROPY_KEYS = ("entropy", "entropies", "token_entropy")
#: The weights version a response was generated with (verl: the agent output's ``extra_fields``;
#: the latest version its model calls saw, verl's ``trajectory_param_versions``).
VERSION_FIELDS = ("max_global_steps", "global_steps")
#: How to record what the per-token numbers need, in one short line: for a verl (agent span) run,
#: and for a run behind the proxy (``rlreplay mismatch --help`` says every way).
HOW_TO_RECORD_SHORT = "per-token figures: record with `rlreplay record --token-signals`"
HOW_TO_RECORD_CALLS = 'per-token figures: POST /rlreplay/signals {"output": {"old_log_probs": [...]}}'


def counted_tokens(mask: Any, rollout: Any, trainer: Any) -> Any:
    """Which tokens count (bool per token): model tokens (``mask``) whose trainer − rollout
    log-prob difference, taken in float64, is a finite number."""
    if rollout.dtype == np.float32 and trainer.dtype == np.float32:  # finite float32s: a finite float64 gap
        return mask & np.isfinite(rollout) & np.isfinite(trainer)
    with np.errstate(all="ignore"):
        return mask & np.isfinite(trainer.astype(np.float64, copy=False) - rollout)


@dataclass
class Response:
    """One response's tokens, as numpy arrays of one length: ids (int64, -1 where not recorded),
    rollout and trainer log-probs (float64, NaN where none), the response mask (bool: True = a
    model token), entropy when recorded (float64, NaN where none)."""

    ids: Any
    rollout: Any
    trainer: Any
    mask: Any
    entropy: Any = None

    #: what was not one per response token (its trainer log-probs then count nothing), or None
    differs: str | None = None

    @property
    def counted(self) -> Any:
        """The tokens the numbers count (:func:`counted_tokens`)."""
        return counted_tokens(self.mask, self.rollout, self.trainer)

    def __len__(self) -> int:
        return len(self.rollout)


def _numbers(values: Any, n: int, fill: float = np.nan) -> Any:
    """``values`` (a list, or a numpy array kept in its dtype) as a numeric array of length ``n``:
    cut, or padded with ``fill`` (for display: :func:`part` says when lengths differ); None when
    they are not numbers (None in a list: NaN; a float marker, NaN or ±inf, its value)."""
    if isinstance(values, np.ndarray):
        array = values
    else:
        try:
            array = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):
            try:  # JSON that held markers (a NaN among the log-probs)
                array = np.asarray(from_json(values), dtype=np.float64)
            except (TypeError, ValueError, NotExact):
                return None
    if array.ndim != 1 or array.dtype.kind not in "biuf":
        return None
    if len(array) == n:
        return array
    if len(array) > n:
        return array[:n]
    return np.concatenate([array.astype(np.float64), np.full(n - len(array), fill)])


@dataclass
class Part:
    """One response's arrays as recorded (numpy in their own dtypes, or None: no ids, no mask =
    every token the model's, no trainer or entropy), all of length ``n``; ``differs`` says which
    recorded array was not ``n`` long (the response is then not compared), else None."""

    n: int
    ids: Any
    mask: Any
    rollout: Any
    trainer: Any
    entropy: Any
    differs: str | None = None


def _length(values: Any) -> int | None:
    try:
        return len(values)
    except TypeError:
        return None


def _differs(n: int, **arrays: Any) -> str | None:
    """Which of ``arrays`` (recorded, not None) is not ``n`` long, said as "NAME: K for N tokens"."""
    found = [
        f"{name.replace('_', ' ')}: {k} for {n} tokens"
        for name, values in arrays.items()
        if values is not None and (k := _length(values)) is not None and k != n
    ]
    return "; ".join(found) or None


def part(ids: Any, mask: Any, rollout: Any, trainer: Any, entropy: Any = None) -> Part | None:
    """The rules of what a response is: its length is the ids' (else the rollout log-probs');
    the rollout's and trainer's log-probs and the mask are one per token, else ``differs`` says
    so (their values are then cut or padded to it, for display only: the response is not
    compared); entropy of another length counts as not recorded; None without rollout log-probs."""
    if rollout is None:
        return None
    n = len(ids) if ids is not None else len(rollout)
    roll = _numbers(rollout, n)
    if roll is None:
        return None
    differs = _differs(n, rollout_log_probs=rollout, trainer_log_probs=trainer, response_mask=mask)
    token_ids = None
    if ids is not None:
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            token_ids = np.asarray(ids, dtype=np.int64) if not isinstance(ids, np.ndarray) else ids
    marks = _numbers(mask, n, 0.0) if mask is not None else None
    if mask is not None and marks is None:
        marks = np.zeros(n, dtype=np.int8)  # a mask that is no list of numbers: nothing counts
    return Part(
        n,
        token_ids,
        marks,
        roll,
        _numbers(trainer, n) if trainer is not None else None,
        _numbers(entropy, n) if entropy is not None and _length(entropy) == n else None,
        differs,
    )


def _model(marks: Any) -> Any:
    """A mask's values as bool: True for a model token (NaN: not)."""
    if marks.dtype.kind == "f":
        return (marks != 0) & ~np.isnan(marks)
    return marks != 0


def response(ids: Any, mask: Any, rollout: Any, trainer: Any, entropy: Any = None) -> Response | None:
    """A response from what was recorded (lists or numpy arrays), by :func:`part`'s rules."""
    found = part(ids, mask, rollout, trainer, entropy)
    if found is None:
        return None
    n = found.n
    compared = found.trainer is not None and found.differs is None
    return Response(
        found.ids.astype(np.int64) if found.ids is not None else np.full(n, -1, dtype=np.int64),
        found.rollout.astype(np.float64),
        found.trainer.astype(np.float64) if compared else np.full(n, np.nan),
        _model(found.mask) if found.mask is not None else np.ones(n, dtype=bool),
        found.entropy.astype(np.float64) if found.entropy is not None else None,
        found.differs,
    )


def _first(source: Any, names: Sequence[str]) -> Any:
    """The first of ``names`` in an op's output (its own dict, when the JSON wraps it)."""
    source = unwrapped(source)
    if isinstance(source, dict):
        for name in names:
            if name in source:
                return source[name]
    return None


def trainer_values(output: Any) -> Any:
    """The trainer's per-token log-probs in a ``signals`` span's output (a list, an array or a
    token-array placeholder), or None."""
    output = unwrapped(output)
    if isinstance(output, (list, np.ndarray)):
        return output
    return _first(output, TRAINER_KEYS)


def version_of(output: Any) -> int | None:
    """The weights version an agent span's output says its response was generated with."""
    value = _first(_first(output, ("extra_fields",)), VERSION_FIELDS)
    return value if type(value) is int else None


def of_calls(calls: Sequence[tuple[Any, Any]], trainer: Any) -> Part | None:
    """A response made of model calls' ``(generated ids, log-probs)`` in call order: each call by
    :func:`part`'s rules, end to end, every token the model's; the trainer's log-probs one per
    token of the whole (cut or padded with NaN); a call with ids and no log-probs keeps its place
    (NaN: not counted). None when no call has log-probs."""
    if all(lps is None for _, lps in calls):
        return None
    parts = []
    for ids, lps in calls:
        if lps is None and isinstance(ids, (list, np.ndarray)):
            lps = np.full(len(ids), np.nan)
        found = part(ids, None, lps, None)
        if found is not None:
            parts.append(found)
    if not parts:
        return None
    n = sum(p.n for p in parts)
    differs = "; ".join(p.differs for p in parts if p.differs) or None
    if trainer is not None:
        differs = "; ".join(filter(None, (differs, _differs(n, trainer_log_probs=trainer)))) or None
    ids = None
    if any(p.ids is not None for p in parts):
        ids = np.concatenate(
            [p.ids.astype(np.int64) if p.ids is not None else np.full(p.n, -1, dtype=np.int64) for p in parts]
        )
    rollout = np.concatenate([p.rollout.astype(np.float64, copy=False) for p in parts])
    return Part(n, ids, None, rollout, _numbers(trainer, n) if trainer is not None else None, None, differs)


def of_trajectory(traj: Any, fields: ConversationFields | None = None) -> Response | None:
    """A loaded trajectory's response: its agent span's ids, mask and log-probs (or, where
    ``fields.response_in`` says so, its model calls' ids and log-probs end to end), the latest
    signals span's trainer log-probs (NaN where none were recorded); None without rollout log-probs."""
    fields = fields or ConversationFields()
    trainer = None
    for span in sorted(traj.by_kind(KIND_SIGNALS), key=lambda s: s.end_ns, reverse=True):
        trainer = trainer_values(span.output)
        if trainer is not None:
            break
    if fields.response_in == RESPONSE_IN_CALLS:
        calls = sorted(traj.by_kind(KIND_LLM), key=lambda s: (s.start_ns, s.end_ns))
        found = of_calls(
            [(_first(s.output, fields.llm_output), _first(s.output, fields.log_probs)) for s in calls],
            trainer,
        )
        if found is None:
            return None
        made = response(found.ids, None, found.rollout, found.trainer)
        if made is not None and found.differs:
            made.trainer[:] = np.nan  # not one trainer log-prob per generated token: nothing counts
            made.differs = found.differs
        return made
    agents = sorted(traj.by_kind(KIND_AGENT), key=lambda s: s.start_ns)
    agent = next(
        (s.output for s in agents if _first(s.output, fields.log_probs) is not None),
        None,
    )
    if agent is None:
        return None
    return response(
        _first(agent, fields.response),
        _first(agent, fields.mask),
        _first(agent, fields.log_probs),
        trainer,
        _first(agent, ENTROPY_KEYS),
    )


# ---- a step at a time ---------------------------------------------------------------------------


@dataclass
class Batch:
    """Responses of one step (or of a set of trajectories) as flat token arrays: response ``i``
    holds tokens ``offsets[i]`` to ``offsets[i + 1]``. ``rows`` are their row numbers in the
    listing they were read for (int64), ``validate`` their split; ``ids`` the token ids (int64;
    None when not read); ``rollout`` and ``trainer`` float32 or float64 as recorded (NaN: none);
    ``mask`` bool; ``version`` the weights version each was generated with (NaN: not recorded)."""

    rows: Any
    validate: Any
    offsets: Any
    ids: Any
    rollout: Any
    trainer: Any
    mask: Any
    entropy: Any
    version: Any

    @property
    def counted(self) -> Any:
        """The tokens the numbers count (:func:`counted_tokens`)."""
        return counted_tokens(self.mask, self.rollout, self.trainer)

    @property
    def sequence(self) -> Any:
        """Each token's response (its index in ``rows``)."""
        return np.repeat(np.arange(len(self.rows)), np.diff(self.offsets))

    @property
    def position(self) -> Any:
        """Each token's position in its response."""
        return np.arange(len(self.rollout)) - np.repeat(self.offsets[:-1], np.diff(self.offsets))

    @property
    def turn(self) -> Any:
        """Each token's model turn in its response (1 for the tokens of the first run of model
        tokens, 2 for the second, ...; the tool tokens after a turn keep its number)."""
        mask, lengths = self.mask, np.diff(self.offsets)
        starts = mask.copy()
        starts[1:] &= ~mask[:-1]
        firsts = self.offsets[:-1][lengths > 0]
        starts[firsts] = mask[firsts]  # a response's first token starts a turn when it is the model's
        total = np.cumsum(starts)
        return total - np.repeat(np.r_[0, total][self.offsets[:-1]], lengths)

    @classmethod
    def of(cls, rows: Any, validate: Any, parts: list[Part], versions: list[Any]) -> Batch:
        """The batch of ``parts`` (one per row), their arrays concatenated once."""
        lengths = np.array([p.n for p in parts], dtype=np.int64)
        offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)

        def flat(name: str, missing: Any) -> Any:
            arrays = [getattr(p, name) for p in parts]
            if not arrays:
                return np.zeros(0, dtype=np.float64)
            return np.concatenate([a if a is not None else missing(p.n) for a, p in zip(arrays, parts)])

        entropy = None
        if any(p.entropy is not None for p in parts):
            entropy = flat("entropy", lambda n: np.full(n, np.nan)).astype(np.float64, copy=False)
        marks = flat("mask", lambda n: np.ones(n, dtype=np.int8))
        ids = None
        if any(p.ids is not None for p in parts):
            ids = flat("ids", lambda n: np.full(n, -1, dtype=np.int64)).astype(np.int64, copy=False)
        return cls(
            np.asarray(rows, dtype=np.int64),
            np.asarray(validate, dtype=bool),
            offsets,
            ids,
            _floating(flat("rollout", lambda n: np.full(n, np.nan, dtype=np.float32))),
            _floating(flat("trainer", lambda n: np.full(n, np.nan, dtype=np.float32))),
            _model(marks) if len(marks) else np.zeros(0, dtype=bool),
            entropy,
            np.array([np.nan if v is None else float(v) for v in versions], dtype=np.float64),
        )


def _floating(values: Any) -> Any:
    """Log-probs as float32 when every one was recorded as float32 (exact), else float64: the
    numbers convert what they count to float64."""
    return values if values.dtype in (np.float32, np.float64) else values.astype(np.float64)


@dataclass
class Counts:
    """Trajectories of the selection read so far: with both sides, and without one of them."""

    selected: int = 0
    compared: int = 0
    no_rollout: int = 0  # no rollout log-probs (where the adapter says the response is)
    no_trainer: int = 0  # no per-token trainer log-probs
    no_trainer_validation: int = 0  # of those, validation trajectories (verl computes none there)
    lengths_differ: int = 0  # trainer's or rollout's log-probs (or mask) not one per response token
    #: of those, per (step, validate); and one example of what differed
    lengths_differ_at: dict[tuple[Any, bool], int] = field(default_factory=dict)
    lengths_example: str | None = None
    issues: list[str] = field(default_factory=list)

    def merge(self, other: Counts) -> None:
        """Add ``other``'s counts (another part of the same selection) to these."""
        for name in (
            "selected",
            "compared",
            "no_rollout",
            "no_trainer",
            "no_trainer_validation",
            "lengths_differ",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for key, k in other.lengths_differ_at.items():
            self.lengths_differ_at[key] = self.lengths_differ_at.get(key, 0) + k
        self.lengths_example = self.lengths_example or other.lengths_example
        self.issues.extend(other.issues)


#: The span columns a step's read takes.
COLUMNS = [
    "trajectory_id",
    "span_id",
    "kind",
    "start_ns",
    "end_ns",
    "inputs",
    "output",
    "token_ids",
    "token_masks",
    "token_logprobs",
]
_KINDS = (KIND_AGENT, KIND_LLM, KIND_SIGNALS)
_TYPED = ("token_ids", "token_masks", "token_logprobs")


def by_step(listing: pa.Table) -> dict[Any, Any]:
    """The listing's row numbers (int64) by step, in listing order; a step recorded as a string
    goes by its string, a trajectory without a step by None."""
    known = ops.is_valid(listing["step"]).to_numpy(zero_copy_only=False)
    steps = ops.fill_null(listing["step"], 0).to_numpy(zero_copy_only=False)
    out: dict[Any, Any] = {}
    rows = np.flatnonzero(known)
    if len(rows):
        values, first, inverse = np.unique(steps[rows], return_index=True, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        cuts = np.searchsorted(inverse[order], np.arange(len(values) + 1))
        for k in np.argsort(first, kind="stable"):  # steps in the order the listing has them
            out[int(values[k])] = rows[order[cuts[k] : cuts[k + 1]]]
    others = np.flatnonzero(~known)
    if len(others):
        texts = ops.take(listing["step_str"], pa.array(others, pa.int64())).to_pylist()
        grouped: dict[Any, list[int]] = {}
        for row, text in zip(others.tolist(), texts):
            grouped.setdefault(text, []).append(row)
        out.update((text, np.asarray(found, dtype=np.int64)) for text, found in grouped.items())
    return out


def read_batches(
    run: Any,
    listing: pa.Table,
    fields: ConversationFields | None = None,
    counts: Counts | None = None,
    ids: bool = True,
) -> Iterator[Batch]:
    """The listing's responses that have both sides, a step at a time (one pass over each step's
    files; memory: one step). ``counts`` (when given) is told what was left out and why;
    without ``ids`` the token ids are not read (None)."""
    fields = fields or ConversationFields()
    counts = counts if counts is not None else Counts()
    columns = [c for c in COLUMNS if ids or c != "token_ids"]
    validate = ops.fill_null(listing["validate"], False).to_numpy(zero_copy_only=False)
    for step, rows in by_step(listing).items():
        counts.selected += len(rows)
        traj_ids = ops.take(listing["id"], pa.array(rows, pa.int64()))
        filters = Filters(step=step) if type(step) is int else Filters(trajectory_id=traj_ids.to_pylist())
        table = run.spans(filters, columns=columns)
        batch = _StepRows(table, traj_ids, rows, validate[rows], fields).batch(counts, step)
        del table
        if batch is not None:
            yield batch


_AGENT, _LLM, _SIGNALS = 0, 1, 2


class _StepRows:
    """One step's span rows of the kinds that hold the two sides, grouped by trajectory in listing
    order: nothing of the table is copied but the payloads of the agent and signals rows."""

    def __init__(
        self, table: pa.Table, ids: pa.Array, rows: Any, validate: Any, fields: ConversationFields
    ) -> None:
        self.rows = rows
        self.validate = validate
        self.fields = fields
        self.table = table
        at = ops.fill_null(ops.index_in(table["trajectory_id"], ids), -1).to_numpy(zero_copy_only=False)
        kind = np.full(table.num_rows, -1, dtype=np.int8)
        for code, name in ((_AGENT, KIND_AGENT), (_LLM, KIND_LLM), (_SIGNALS, KIND_SIGNALS)):
            kind[ops.fill_null(ops.equal(table["kind"], name), False).to_numpy(zero_copy_only=False)] = code
        chosen = np.flatnonzero((at >= 0) & (kind >= 0))
        start = table["start_ns"].to_numpy(zero_copy_only=False)[chosen]
        self.order = order = chosen[np.lexsort((start, at[chosen]))]  # by trajectory, then start
        self.starts = np.searchsorted(at[order], np.arange(len(rows) + 1))
        self.kinds = kind[order].tolist()
        self.end_ns = table["end_ns"].to_numpy(zero_copy_only=False)[order]
        self.in_calls = fields.response_in == RESPONSE_IN_CALLS
        # the llm rows' payloads only when they hold the response, or a stretch refers to them
        payload_rows = order if self.in_calls else order[kind[order] != _LLM]
        texts = ops.take(table["output"], pa.array(payload_rows, pa.int64())).to_pylist()
        self.outputs: dict[int, Any] = dict(zip(payload_rows.tolist(), texts))
        self.typed = {}
        for name in _TYPED:
            if name in table.column_names:
                chunk = table[name].combine_chunks()
                self.typed[name] = (chunk.offsets.to_numpy(), chunk.values.to_numpy(zero_copy_only=False))

    def columns(self, row: int) -> dict[str, Any]:
        """Table row ``row``'s typed token values."""
        return {
            name: values[offsets[row] : offsets[row + 1]] for name, (offsets, values) in self.typed.items()
        }

    def batch(self, counts: Counts, step: Any = None) -> Batch | None:
        kept, parts, versions = [], [], []
        for i in range(len(self.rows)):
            found = self.response(int(self.starts[i]), int(self.starts[i + 1]), counts)
            if found is None:
                counts.no_rollout += 1
                continue
            got, version = found
            if got.trainer is None:
                counts.no_trainer += 1
                counts.no_trainer_validation += bool(self.validate[i])
                continue
            if got.differs is not None:
                key = (step, bool(self.validate[i]))
                counts.lengths_differ += 1
                counts.lengths_differ_at[key] = counts.lengths_differ_at.get(key, 0) + 1
                counts.lengths_example = counts.lengths_example or got.differs
                continue
            counts.compared += 1
            kept.append(i)
            parts.append(got)
            versions.append(version)
        if not kept:
            return None
        return Batch.of(self.rows[kept], self.validate[kept], parts, versions)

    def output(self, row: int, counts: Counts) -> Any:
        text = self.outputs.get(row)
        if text is None and row not in self.outputs:
            text = self.table["output"][row].as_py()
        value, why = decode_safe(text)
        if why:
            counts.issues.append(f"span {self.table['span_id'][row].as_py()}: {why}")
        return value

    def response(self, lo: int, hi: int, counts: Counts) -> tuple[Part, int | None] | None:
        """The trajectory's response from its rows ``order[lo:hi]`` (its first agent span holding
        rollout log-probs, its latest signals span holding trainer log-probs), with its weights
        version."""
        agent = trainer = None
        latest = -1
        calls: list[tuple[int, Any]] = []
        for k in range(lo, hi):
            kind = self.kinds[k]
            if kind == _LLM and self.in_calls:
                calls.append((int(self.order[k]), self.output(int(self.order[k]), counts)))
            elif kind == _AGENT and agent is None and not self.in_calls:
                output = self.output(int(self.order[k]), counts)
                if _first(output, self.fields.log_probs) is not None:
                    agent = (int(self.order[k]), output)
            elif kind == _SIGNALS and self.end_ns[k] >= latest:
                values = trainer_values(self.output(int(self.order[k]), counts))
                if values is not None:
                    trainer, latest = (int(self.order[k]), values), self.end_ns[k]
        if self.in_calls:
            context = _Stretches(self, range(lo, hi), counts)
            fields = self.fields
            found = of_calls(
                [
                    (
                        context.array(_first(output, fields.llm_output), row),
                        context.array(_first(output, fields.log_probs), row),
                    )
                    for row, output in calls
                ],
                context.array(trainer[1], trainer[0]) if trainer is not None else None,
            )
            context.done()
            return (found, None) if found is not None else None
        if agent is None:
            return None
        row, output = agent
        context = _Stretches(self, range(lo, hi), counts)
        found = part(
            context.array(_first(output, self.fields.response), row),
            context.array(_first(output, self.fields.mask), row),
            context.array(_first(output, self.fields.log_probs), row),
            context.array(trainer[1], trainer[0]) if trainer is not None else None,
            context.array(_first(output, ENTROPY_KEYS), row),
        )
        context.done()
        return (found, version_of(output)) if found is not None else None


class _Stretches:
    """A trajectory's number lists as numpy: JSON lists as they are, token-array placeholders
    sliced from their row's typed column, or (those sharing stretches with other spans) restored
    through ``rlreplay.format.arrays.Restorer``, the other spans' payloads read when needed."""

    def __init__(self, step: _StepRows, group: range, counts: Counts) -> None:
        self.step = step
        self.group = group
        self.counts = counts
        self.restorer: Restorer | None = None

    def array(self, value: Any, row: int) -> Any:
        if isinstance(value, list):
            return value
        if not (isinstance(value, dict) and value.get("__type__") == TOKENS):
            return None
        if value.get("r"):  # shares stretches with other spans
            found = self.restore().stream(value, self.step.columns(row), value.get("t"))
            return found[0][1] if found else None
        column = DTYPE_COLUMNS.get(value.get("t"), "")
        if column not in self.step.typed:  # a column not read (token ids, when not asked for)
            return None
        offsets, values = self.step.typed[column]
        try:
            start, n = int(value["o"]), int(value["n"])
        except (KeyError, TypeError, ValueError):
            return None
        if start < 0 or start + n > offsets[row + 1] - offsets[row]:
            self.counts.issues.append(f"unreadable token array ({value.get('t')} out of range)")
            return None
        first = offsets[row] + start
        return values[first : first + n]

    def restore(self) -> Restorer:
        if self.restorer is not None:
            return self.restorer
        step = self.step
        rows = [int(step.order[k]) for k in self.group]
        by_span = dict(zip(ops.take(step.table["span_id"], pa.array(rows, pa.int64())).to_pylist(), rows))
        streams: dict[tuple[str, str], Any] = {}

        def resolve(span_id: str, dtype: str) -> Any:
            row, key = by_span.get(span_id), (span_id, dtype)
            if row is None or key in streams:
                return streams.get(key)
            streams[key] = None  # a reference circle resolves to nothing
            inputs, why = decode_safe(step.table["inputs"][row].as_py())
            if why:
                self.counts.issues.append(f"span {span_id}: {why}")
            output = step.output(row, self.counts)
            streams[key] = restorer.span_stream(inputs, output, step.columns(row), dtype)
            return streams[key]

        self.restorer = restorer = Restorer(resolve)
        return restorer

    def done(self) -> None:
        if self.restorer is not None:
            self.counts.issues.extend(self.restorer.issues)
            self.restorer.resolve = None  # no reference circle: the step's rows go once it is done with
