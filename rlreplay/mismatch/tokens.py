"""Each recorded response's tokens with the rollout's and the trainer's log-probs, and which count.

The rollout side is the agent span's response log-probs (verl: ``AgentLoopOutput.response_logprobs``)
with its response mask (``response_mask``: 1 = a token the model sampled, 0 = a tool or observation
token); the trainer side is the ``signals`` span's ``old_log_probs`` (verl with ``rlreplay record
--token-signals``; with the generic API, ``record_signals(..., output={"old_log_probs": [...]})``),
one per response token. A token *counts* when the mask says the model sampled it and both
log-probs are numbers: the one definition the mismatch numbers, the audit and the UI overlay use.

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

from rlreplay.format import arrow_ops as ops
from rlreplay.format.arrays import DTYPE_COLUMNS, Restorer
from rlreplay.format.kinds import KIND_AGENT, KIND_LLM, KIND_SIGNALS
from rlreplay.format.payload import TOKENS, decode_safe
from rlreplay.model import listing_rows
from rlreplay.read.filters import Filters
from rlreplay.text.conversation import ConversationFields

#: Where the trainer's per-token log-probs live in a ``signals`` span's output (verl: old_log_probs).
TRAINER_KEYS = ("old_log_probs", "trainer_log_probs", "log_probs", "logprobs")
#: Per-token entropy, where the agent span's output (or the signals span's) records it.
ENTROPY_KEYS = ("entropy", "entropies", "token_entropy")
#: The weights version a response was generated with (verl: the agent output's ``extra_fields``;
#: the latest version its model calls saw, verl's ``trajectory_param_versions``).
VERSION_FIELDS = ("max_global_steps", "global_steps")
#: How to record what the mismatch numbers need, said where a run lacks it.
HOW_TO_RECORD = (
    "record verl with `rlreplay record --token-signals ...` (or RLREPLAY_TOKEN_SIGNALS=1); with the "
    'generic API, `rlreplay.recorder.record_signals(trajectory_id, ..., output={"old_log_probs": [...]})` '
    "with one trainer log-prob per response token, beside an agent span whose output holds "
    "response_ids, response_mask and response_logprobs"
)


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

    @property
    def counted(self) -> Any:
        """The tokens the numbers count: model tokens with both log-probs."""
        return self.mask & np.isfinite(self.rollout) & np.isfinite(self.trainer)

    def __len__(self) -> int:
        return len(self.rollout)


def _floats(values: Any, n: int) -> Any:
    """``values`` (a list or an array) as float64 of length ``n``: cut, or padded with NaN; None
    when they are not numbers."""
    try:
        array = np.asarray(values, dtype=np.float64)  # None becomes NaN
    except (TypeError, ValueError):
        return None
    if array.ndim != 1:
        return None
    if len(array) >= n:
        return array[:n]
    return np.concatenate([array, np.full(n - len(array), np.nan)])


def response(ids: Any, mask: Any, rollout: Any, trainer: Any, entropy: Any = None) -> Response | None:
    """A response from what was recorded (lists or numpy arrays): its length is the ids' (else
    the rollout log-probs'); the trainer's log-probs are cut or padded (NaN) to it; no mask means
    every token is the model's. None without rollout log-probs."""
    if rollout is None:
        return None
    n = len(ids) if ids is not None else len(rollout)
    roll = _floats(rollout, n)
    if roll is None:
        return None
    train = _floats(trainer, n) if trainer is not None else None
    if train is None:
        train = np.full(n, np.nan)
    token_ids = np.full(n, -1, dtype=np.int64)
    if ids is not None:
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            token_ids = np.asarray(ids, dtype=np.int64)[:n]
    if mask is None:
        model = np.ones(n, dtype=bool)
    else:
        marks = _floats(mask, n)
        model = np.zeros(n, dtype=bool) if marks is None else np.nan_to_num(marks, nan=0.0) != 0
    ent = _floats(entropy, n) if entropy is not None else None
    return Response(token_ids, roll, train, model, ent)


def _first(source: Any, names: Sequence[str]) -> Any:
    if isinstance(source, dict):
        for name in names:
            if name in source:
                return source[name]
    return None


def trainer_values(output: Any) -> Any:
    """The trainer's per-token log-probs in a ``signals`` span's output (a list, an array or a
    token-array placeholder), or None."""
    if isinstance(output, (list, np.ndarray)):
        return output
    return _first(output, TRAINER_KEYS)


def version_of(output: Any) -> int | None:
    """The weights version an agent span's output says its response was generated with."""
    extra = output.get("extra_fields") if isinstance(output, dict) else None
    value = _first(extra, VERSION_FIELDS)
    return value if type(value) is int else None


def of_trajectory(traj: Any, fields: ConversationFields | None = None) -> Response | None:
    """A loaded trajectory's response: its agent span's ids, mask and log-probs, the latest
    signals span's trainer log-probs (NaN where none were recorded); None without an agent span
    holding rollout log-probs."""
    fields = fields or ConversationFields()
    agents = sorted(traj.by_kind(KIND_AGENT), key=lambda s: s.start_ns)
    agent = next(
        (s.output for s in agents if _first(s.output, fields.log_probs) is not None),
        None,
    )
    if agent is None:
        return None
    trainer = None
    for span in sorted(traj.by_kind(KIND_SIGNALS), key=lambda s: s.end_ns, reverse=True):
        trainer = trainer_values(span.output)
        if trainer is not None:
            break
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
    holds tokens ``offsets[i]`` to ``offsets[i + 1]``. ``rows`` are their listing rows (id, keys,
    validate, worker); ``version`` the weights version each was generated with (NaN: not
    recorded)."""

    rows: list[dict[str, Any]]
    offsets: Any
    ids: Any
    rollout: Any
    trainer: Any
    mask: Any
    entropy: Any
    version: Any

    @property
    def counted(self) -> Any:
        return self.mask & np.isfinite(self.rollout) & np.isfinite(self.trainer)

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
    def of(cls, rows: list[dict[str, Any]], responses: list[Response], versions: list[Any]) -> Batch:
        lengths = [len(r) for r in responses]
        offsets = np.r_[0, np.cumsum(lengths, dtype=np.int64)].astype(np.int64)

        def flat(name: str, dtype: Any) -> Any:
            parts = [getattr(r, name) for r in responses]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        entropy = None
        if any(r.entropy is not None for r in responses):
            entropy = np.concatenate(
                [r.entropy if r.entropy is not None else np.full(len(r), np.nan) for r in responses]
            )
        return cls(
            rows,
            offsets,
            flat("ids", np.int64),
            flat("rollout", np.float64),
            flat("trainer", np.float64),
            flat("mask", bool),
            entropy,
            np.array([np.nan if v is None else float(v) for v in versions], dtype=np.float64),
        )


@dataclass
class Counts:
    """Trajectories of the selection read so far: with both sides, and without one of them."""

    selected: int = 0
    compared: int = 0
    no_rollout: int = 0  # no agent span with rollout log-probs
    no_trainer: int = 0  # no per-token trainer log-probs
    no_trainer_validation: int = 0  # of those, validation trajectories (verl computes none there)
    issues: list[str] = field(default_factory=list)


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


def by_step(listing: pa.Table) -> dict[Any, list[dict[str, Any]]]:
    """The listing's rows by step, in listing order (a step recorded as a string: its string)."""
    out: dict[Any, list[dict[str, Any]]] = {}
    names = ["id", "step", "step_str", "sample_index", "sample_index_str", "rollout_n", "rollout_n_str"]
    for row in listing_rows(listing.select([*names, "validate", "worker"])):
        out.setdefault(row["step"], []).append(row)
    return out


def read_batches(
    run: Any, listing: pa.Table, fields: ConversationFields | None = None, counts: Counts | None = None
) -> Iterator[Batch]:
    """The listing's responses that have both sides, a step at a time (one pass over each step's
    files; memory: one step). ``counts`` (when given) is told what was left out and why."""
    fields = fields or ConversationFields()
    counts = counts if counts is not None else Counts()
    for step, rows in by_step(listing).items():
        counts.selected += len(rows)
        filters = Filters(step=step) if type(step) is int else Filters(trajectory_id=[r["id"] for r in rows])
        table = run.spans(filters, columns=COLUMNS)
        batch = _StepRows(table, rows, fields).batch(counts)
        if batch is not None:
            yield batch


class _StepRows:
    """One step's span rows of the chosen kinds, grouped by trajectory in listing order."""

    def __init__(self, table: pa.Table, rows: list[dict[str, Any]], fields: ConversationFields) -> None:
        self.rows = rows
        self.fields = fields
        ids = pa.array([r["id"] for r in rows], pa.string())
        position = ops.index_in(table["trajectory_id"], ids)
        keep = ops.and_(ops.is_valid(position), ops.is_in(table["kind"], pa.array(_KINDS, pa.string())))
        table = ops.filter(table.append_column("_at", position), keep)
        order = ops.sort_indices(
            table, [("_at", "ascending"), ("start_ns", "ascending"), ("end_ns", "descending")]
        )
        self.table = table = ops.take(table, order).combine_chunks()
        at = table["_at"].to_numpy()
        self.starts = np.searchsorted(at, np.arange(len(rows) + 1))
        self.kinds = table["kind"].to_pylist()
        self.span_ids = table["span_id"].to_pylist()
        self.end_ns = table["end_ns"].to_numpy()
        self.outputs = table["output"]
        self.inputs = table["inputs"]
        self.typed = {}
        for name in _TYPED:
            column = table[name]
            chunk = column.chunk(0) if column.num_chunks else pa.array([], column.type)
            self.typed[name] = (chunk.offsets.to_numpy(), chunk.values.to_numpy(zero_copy_only=False))

    def columns(self, j: int) -> dict[str, Any]:
        """Row ``j``'s typed token values."""
        return {name: values[offsets[j] : offsets[j + 1]] for name, (offsets, values) in self.typed.items()}

    def batch(self, counts: Counts) -> Batch | None:
        kept_rows, responses, versions = [], [], []
        for i, row in enumerate(self.rows):
            found = self.response(range(self.starts[i], self.starts[i + 1]), counts)
            if found is None:
                counts.no_rollout += 1
                continue
            resp, version = found
            if not np.isfinite(resp.trainer).any():
                counts.no_trainer += 1
                counts.no_trainer_validation += bool(row["validate"])
                continue
            counts.compared += 1
            kept_rows.append(row)
            responses.append(resp)
            versions.append(version)
        return Batch.of(kept_rows, responses, versions) if kept_rows else None

    def response(self, group: range, counts: Counts) -> tuple[Response, int | None] | None:
        """The trajectory's response from its rows ``group`` (its agent span, its latest signals
        span), with its weights version."""
        decoded: dict[int, tuple[Any, Any]] = {}
        streams: dict[tuple[str, str], Any] = {}
        by_span = {self.span_ids[j]: j for j in group}

        def payloads(j: int, inputs: bool = True) -> tuple[Any, Any]:
            if j not in decoded or (inputs and decoded[j][0] is None):
                out, why = decode_safe(self.outputs[j].as_py())
                inp = None
                if inputs:
                    inp, why_in = decode_safe(self.inputs[j].as_py())
                    why = why or why_in
                if why:
                    counts.issues.append(f"span {self.span_ids[j]}: {why}")
                decoded[j] = (inp, out)
            return decoded[j]

        def resolve(span_id: str, dtype: str) -> Any:
            j, key = by_span.get(span_id), (span_id, dtype)
            if j is None or key in streams:
                return streams.get(key)
            streams[key] = None  # a reference circle resolves to nothing
            inputs, output = payloads(j)
            streams[key] = restorer.span_stream(inputs, output, self.columns(j), dtype)
            return streams[key]

        restorer = Restorer(resolve)
        agent = None
        trainer_at = None
        for j in group:
            kind = self.kinds[j]
            if kind == KIND_AGENT and agent is None:
                _, output = payloads(j, inputs=False)
                if _first(output, self.fields.log_probs) is not None:
                    agent = (j, output)
            elif kind == KIND_SIGNALS and (
                trainer_at is None or self.end_ns[j] >= self.end_ns[trainer_at[0]]
            ):
                _, output = payloads(j, inputs=False)
                values = trainer_values(output)
                if values is not None:
                    trainer_at = (j, values)
        if agent is None:
            return None
        j, output = agent
        cols = self.columns(j)
        values = {
            name: self.array(_first(output, names), cols, restorer)
            for name, names in (
                ("ids", self.fields.response),
                ("mask", self.fields.mask),
                ("rollout", self.fields.log_probs),
                ("entropy", ENTROPY_KEYS),
            )
        }
        trainer = self.array(trainer_at[1], self.columns(trainer_at[0]), restorer) if trainer_at else None
        counts.issues.extend(restorer.issues)
        restorer.resolve = None  # no reference circle: the step's rows go once it is done with
        found = response(values["ids"], values["mask"], values["rollout"], trainer, values["entropy"])
        return (found, version_of(output)) if found is not None else None

    @staticmethod
    def array(value: Any, cols: dict[str, Any], restorer: Restorer) -> Any:
        """A recorded number list as numpy: JSON numbers, or a token-array placeholder (resolved
        where it shares stretches with other spans); None when it is neither."""
        if isinstance(value, list):
            return value
        if not (isinstance(value, dict) and value.get("__type__") == TOKENS):
            return None
        dtype = value.get("t")
        if "s" in value:  # a shared stream's array: resolved through the restorer
            found = restorer.stream(value, cols, dtype)
            return found[0][1] if found else None
        column = cols.get(DTYPE_COLUMNS.get(dtype, ""))
        try:
            start, n = int(value["o"]), int(value["n"])
        except (KeyError, TypeError, ValueError):
            return None
        if column is None or start < 0 or start + n > len(column):
            return None
        return column[start : start + n]
