"""Span rows: turning a finished call (a span event) into a row of the span schema, and rows into batches.

This is the recorder's encoding, apart from its batching policy (``writer``) and from where batches
go (``shards.sink``). It runs on the recorder's writer thread (or on a caller spilling a full queue)
and never raises: a value that cannot be kept as given is made safe, costing only that value, and
the change is returned as a :class:`Problem` for the caller to count (``encode_errors``) and warn.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from rlreplay.format import arrays as token_arrays
from rlreplay.format import payload, tool_errors
from rlreplay.format import redact as redaction
from rlreplay.format.keys import KEYS, key_value
from rlreplay.format.schema import (
    KIND_AGENT,
    KIND_SIGNALS,
    KIND_TOOL,
    KIND_TRAJECTORY,
    SIGNAL_COLUMNS,
    SPAN_SCHEMA,
    STATUS_ERROR,
    STATUS_OK,
    TOKEN_COLUMNS,
)
from rlreplay.recorder.events import SpanEvent, format_span_id, format_trajectory_id

COLUMN_NAMES = tuple(SPAN_SCHEMA.names)
_TOKEN_START = COLUMN_NAMES.index("token_ids")
_TRAJECTORY_ID = COLUMN_NAMES.index("trajectory_id")
_NUMPY_TYPES = {"int32": np.int32, "int8": np.int8, "float": np.float32}


class Problem(NamedTuple):
    """Something encoding changed or could not do; warned once per ``key``."""

    key: str
    message: str
    counted: bool = True  # a value not kept as given (counted in encode_errors); False: a warning only


_PROMPT_KEYS = ("prompt_ids",)
_RESPONSE_KEYS = ("response_ids", "token_ids", "output_ids")


_SCALARS = pa.struct(list(SPAN_SCHEMA)[:_TOKEN_START])  # every column but the typed token lists


class StepBuffer:
    """Encoded rows of one step waiting to be written as a batch."""

    __slots__ = ("first_at", "nbytes", "rows", "table")

    def __init__(self) -> None:
        self.table: list[tuple] = []
        self.rows = 0
        self.nbytes = 0
        self.first_at = 0.0  # when the first row of the coming batch was added (monotonic)

    def append(self, row: tuple, nbytes: int) -> None:
        if not self.rows:
            self.first_at = time.monotonic()
        self.table.append(row)
        self.rows += 1
        self.nbytes += nbytes

    def take_batch(self) -> tuple[pa.RecordBatch, list[Problem]]:
        """The buffered rows as a batch, and the buffer emptied. Never raises: a value Arrow
        refuses is made safe (or null) alone, and returned as a problem."""
        table, self.table = self.table, []
        self.rows = self.nbytes = 0
        problems: list[Problem] = []
        tokens = [_list_column([row[i] for row in table], f.type) for i, f in _TOKEN_FIELDS]
        try:  # one conversion for all scalar columns: a call per column costs ~6 us, whatever its size
            scalars = pa.array([row[:_TOKEN_START] for row in table], type=_SCALARS)
        except Exception:
            columns = zip(*table) if table else ([] for _ in COLUMN_NAMES)
            arrays = [_column(list(values), f, problems) for values, f in zip(columns, _SCALARS)]
            return pa.RecordBatch.from_arrays([*arrays, *tokens], schema=SPAN_SCHEMA), problems
        # SPAN_SCHEMA itself: a stream writer compares a batch's schema with its own at each write,
        # at once when they are the same object, by fingerprints (~17k instructions) otherwise
        return pa.RecordBatch.from_arrays([*scalars.flatten(), *tokens], schema=SPAN_SCHEMA), problems


def trajectory_ids(table: list[tuple]) -> set[str]:
    """The trajectories that rows belong to."""
    return {row[_TRAJECTORY_ID] for row in table}


_TOKEN_FIELDS = [(i, f) for i, f in enumerate(SPAN_SCHEMA) if i >= _TOKEN_START]


def _column(values: list, field: pa.Field, problems: list[Problem]) -> pa.Array:
    if field.name in TOKEN_COLUMNS:
        return _list_column(values, field.type)
    try:
        return pa.array(values, type=field.type)
    except Exception:
        pass
    fixed = []
    for value in values:
        try:
            pa.array([value], type=field.type)
            fixed.append(value)
            continue
        except Exception:
            pass
        safe = payload.safe_text(value) if isinstance(value, str) else None
        if safe is None and not field.nullable:
            safe = "" if pa.types.is_string(field.type) or pa.types.is_large_string(field.type) else 0
        fixed.append(safe)
        problems.append(
            Problem(
                "encode:column",
                f"a value of column {field.name} could not be stored ({type(value).__name__})",
            )
        )
    return pa.array(fixed, type=field.type)


def _list_column(values: list, typ: pa.DataType) -> pa.Array:
    """A large_list column from per-row numpy arrays (a list of arrays: taken end to end; None:
    empty), in one copy."""
    value_type = typ.value_type
    lengths = [0] * len(values)
    parts = []
    for i, array in enumerate(values):
        if array is None:
            continue
        if type(array) is list:
            lengths[i] = sum(map(len, array))
            parts += array
        elif len(array):
            lengths[i] = len(array)
            parts.append(array)
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = _NUMPY_TYPES[str(value_type)]
    flat = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))


class PrefixCache:
    """Per open trajectory, the id streams that its next spans may share a prefix with (bounded in
    bytes and in trajectories: the least recently used goes first)."""

    def __init__(self, max_bytes: int = 64 << 20, max_trajectories: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.max_trajectories = max_trajectories
        self._by_trajectory: OrderedDict[Any, token_arrays.SharedIndex] = OrderedDict()
        self._bytes = 0

    def get(self, trajectory: Any) -> token_arrays.SharedIndex:
        index = self._by_trajectory.get(trajectory)
        if index is None:
            index = self._by_trajectory[trajectory] = token_arrays.SharedIndex()
            if len(self._by_trajectory) > self.max_trajectories:
                _, old = self._by_trajectory.popitem(last=False)
                self._bytes -= old.nbytes
        else:
            self._by_trajectory.move_to_end(trajectory)
        return index

    def peek(self, trajectory: Any) -> token_arrays.SharedIndex | None:
        """The trajectory's index if it has one (none is made)."""
        return self._by_trajectory.get(trajectory)

    def added(self, trajectory: Any, before: int, after: int) -> None:
        self._bytes += after - before
        while self._bytes > self.max_bytes and len(self._by_trajectory) > 1:
            _, index = self._by_trajectory.popitem(last=False)
            self._bytes -= index.nbytes

    def drop(self, trajectory: Any) -> None:
        index = self._by_trajectory.pop(trajectory, None)
        if index is not None:
            self._bytes -= index.nbytes

    def clear(self) -> None:
        self._by_trajectory.clear()
        self._bytes = 0


def key_parts(value: Any) -> tuple[int | None, str | None, str | None]:
    """(int value, string value, problem) for a key, by ``format.keys.key_value``'s rule: ints
    (numpy ints too) stay ints, strings stay strings; anything else is kept as its ``str()`` and
    described as a problem."""
    stored = key_value(value)
    if stored is None or isinstance(stored, int):
        return stored, None, None
    safe = payload.safe_text(stored)
    if type(value) is str:
        return None, safe, None if safe is value else "a key that is not valid Unicode"
    if isinstance(value, str):
        return None, safe, None
    return None, safe, f"a key of type {type(value).__name__} was stored as the string {safe[:40]!r}"


def key_columns(traj: Any, experiment: str | None) -> tuple[list, list, str | None, list[str]]:
    """A trajectory's key as its rows store it: the int and string columns of step, sample_index
    and rollout_n, the experiment (``experiment``: the recorder's, when the trajectory names
    none), and what storing them changed."""
    issues: list[str] = []
    key = traj.key
    ints, strs = [], []
    for value in traj.given or (getattr(key, k) for k in KEYS):
        number, text, issue = key_parts(value)
        ints.append(number)
        strs.append(text)
        if issue:
            issues.append(issue)
    name = key.experiment or experiment
    return ints, strs, None if name is None else _text(name, issues), issues


def encode_row(
    event: SpanEvent, config: Any, worker: str, prefixes: PrefixCache | None = None
) -> tuple[tuple | None, int, list[Problem]]:
    """The span's row, in SPAN_SCHEMA column order, its approximate encoded size, and the problems met.

    ``config`` carries ``experiment`` and ``max_field_bytes``; ``prefixes`` (the writer thread's)
    lets id lists share prefixes with the trajectory's earlier spans. A failing user reducer leaves
    a marker in its span and a warning (a problem not counted). Never raises: a span that cannot be
    encoded at all has no row (None) and a problem, and its trajectory shares nothing older.
    """
    problems: list[Problem] = []
    try:
        row, nbytes = _encode_row(event, config, worker, prefixes, problems)
    except Exception as exc:
        problems.append(Problem("encode", f"could not encode a span: {type(exc).__name__}: {exc}"))
        if prefixes is not None:
            with contextlib.suppress(Exception):
                prefixes.drop(trajectory_id(event.traj.id))
        return None, 0, problems
    return row, nbytes, problems


def trajectory_id(traj_id: int | str) -> str:
    """A trajectory's id as stored: a process counter formatted, a recorded id as it is."""
    return traj_id if type(traj_id) is str else format_trajectory_id(traj_id)


def _encode_row(
    event: SpanEvent, config: Any, worker: str, prefixes: PrefixCache | None, problems: list[Problem]
) -> tuple[tuple, int]:
    traj, span_id, parent_id, meta, exc = event.traj, event.span_id, event.parent_id, event.meta, event.exc
    args, kwargs, result = event.args, event.kwargs, event.result
    cap = config.max_field_bytes
    issues: list[str] = []
    tid = trajectory_id(traj.id)
    sid = span_id if type(span_id) is str else format_span_id(span_id)
    pid = None if parent_id is None else parent_id if type(parent_id) is str else format_span_id(parent_id)
    signals: dict[str, Any] = {}
    kinds: dict[int, Any] = {}  # number lists to_jsonable kept, for Arrays
    index = None
    if prefixes is not None:  # signals come after a trajectory ended: they open no index
        index = prefixes.peek(tid) if meta.kind == KIND_SIGNALS else prefixes.get(tid)
    arrays = token_arrays.Arrays(index, kinds)
    inputs_data: Any = None
    num_tokens = 0
    if meta.kind == KIND_SIGNALS:
        signals = kwargs
    elif meta.kind != KIND_TRAJECTORY:
        inputs_obj = _bound(meta, args, kwargs, problems)
        if meta.reduce_inputs is not None:
            inputs_obj = _reduce(meta, "reduce_inputs", meta.reduce_inputs, inputs_obj, problems)
        inputs_data, num_tokens = payload.to_payload(inputs_obj, issues, kinds, arrays.ints)
    reward = None
    output_type: dict[str, str] | None = None  # what the JSON form does not say (replay reads it)
    if exc is not None:
        output_data: Any = _redacted(exception_data(exc))
        error = payload.safe_text(f"{output_data['type']}: {output_data['message']}")
    else:
        out = result
        if meta.reduce_output is not None:
            out = _reduce(meta, "reduce_output", meta.reduce_output, result, problems)
        output_data = None
        if out is not None:
            output_type = {} if meta.kind not in (KIND_TRAJECTORY, KIND_SIGNALS) else None
            output_data, output_tokens = payload.to_payload(out, issues, kinds, arrays.ints, output_type)
            num_tokens += output_tokens
            if output_type is not None and meta.reduce_output is not None:
                output_type = {"": payload.REDUCED}
        # a tool call that returned a failure: why, as every reader counts it (its status stays ok)
        error = tool_errors.returned_error(output_data) if meta.kind == KIND_TOOL else None
        if meta.reward is not None:
            reward = as_reward(_reduce(meta, "reward", meta.reward, result, problems))
        elif isinstance(output_data, dict):
            reward = as_reward(output_data.get("reward_score", output_data.get("reward")))
    if signals:
        reward = as_reward(signals.get("reward"))
    prompt_tokens, response_tokens = token_counts(meta.kind, inputs_data, output_data)

    inputs_text = None
    if inputs_data is not None:
        inputs_text = payload.dumps(arrays.extract(inputs_data), cap, issues)
    output_text = None
    if output_data is not None:
        output_text = payload.dumps(arrays.extract(output_data), cap, issues)
    if index is not None:
        if parent_id is None and meta.kind != KIND_SIGNALS:
            prefixes.drop(tid)  # the trajectory ended
        elif arrays.id_count and not (_truncated(inputs_text) or _truncated(output_text)):
            before = index.nbytes
            index.add(sid, arrays)
            prefixes.added(tid, before, index.nbytes)
    attributes = None
    rooted = traj.attributes and (parent_id is None or meta.kind == KIND_SIGNALS)
    given = traj.attributes if rooted else meta.attributes
    if given:
        attrs = payload.to_payload(given, issues)[0]  # secrets hidden, as in inputs and outputs
        if output_type and isinstance(attrs, dict):
            attrs[payload.OUTPUT_TYPE] = output_type
        attributes = payload.dumps(attrs, None, issues)
    elif output_type:
        attributes = payload.dumps({payload.OUTPUT_TYPE: output_type}, None, issues)

    if traj.columns is None:  # once per trajectory
        traj.columns = key_columns(traj, config.experiment)
    ints, strs, experiment, key_issues = traj.columns
    issues += key_issues
    for issue in issues:
        problems.append(Problem("encode:value", f"a value could not be recorded as given: {issue}"))
    row = (
        tid,
        sid,
        pid,
        _text(meta.name, issues),
        meta.kind,
        event.start_ns,
        event.end_ns,
        STATUS_OK if exc is None else STATUS_ERROR,
        error,
        worker,
        experiment,
        traj.validate,
        *ints,
        *strs,
        reward,
        *(_float(signals.get(c)) for c in SIGNAL_COLUMNS[1:]),
        num_tokens,
        prompt_tokens,
        response_tokens,
        attributes,
        inputs_text,
        output_text,
        *arrays.column_parts(),
    )
    return row, 200 + len(inputs_text or "") + len(output_text or "") + arrays.bytes


def _truncated(text: str | None) -> bool:
    return text is not None and '"__type__":"truncated"' in text


def _text(value: Any, issues: list[str]) -> str:
    text = value if type(value) is str else str(value)
    safe = payload.safe_text(text)
    if safe is not text:
        issues.append(f"a string that is not valid Unicode: {safe[:80]}")
    return safe


def _float(value: Any) -> float | None:
    return as_reward(value)


def _bound(meta: Any, args: tuple, kwargs: dict, problems: list[Problem]) -> Any:
    try:
        inputs = meta.bind(args, kwargs)
    except Exception as exc:
        problems.append(
            Problem("encode:bind", f"could not bind the arguments of {meta.name}: {type(exc).__name__}")
        )
        inputs = {"args": list(args), **kwargs}
    return inputs


def _redacted(data: Any) -> Any:
    """A payload with its secrets hidden (the same rules for inputs, outputs and errors)."""
    try:
        return redaction.redact_data(data)
    except Exception:
        return {k: redaction.REDACTED for k in data} if isinstance(data, dict) else redaction.REDACTED


def token_counts(kind: str, inputs: Any, output: Any) -> tuple[int | None, int | None]:
    """(prompt, response) token counts of a span's payloads (None where it holds no such list)."""
    prompt = response = None
    source = output if kind == KIND_AGENT else inputs
    for data in (source, output):
        if isinstance(data, dict) and prompt is None:
            prompt = _length(data, _PROMPT_KEYS)
    if isinstance(output, dict):
        response = _length(output, _RESPONSE_KEYS)
    return prompt, response


def _length(data: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = data.get(key)
        if type(value) is list or type(value) is tuple:
            return len(value)
    return None


def _reduce(meta: Any, what: str, fn: Callable[[Any], Any], value: Any, problems: list[Problem]) -> Any:
    """A user-supplied reducer's result; if it raises, an error marker (the span is kept)."""
    try:
        return fn(value)
    except Exception as exc:
        message = payload.safe_text(f"{what} of {meta.name} raised {type(exc).__name__}: {exc}")
        problems.append(Problem(f"reduce:{meta.name}:{what}", message, counted=False))
        return None if what == "reward" else payload.Marker(__type__="error", error=message[:2000])


def exception_data(exc: BaseException) -> dict[str, str]:
    try:
        message = payload.safe_text(str(exc))
    except Exception:
        message = "<str() failed>"
    try:
        tb = payload.safe_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    except Exception:
        tb = ""
    return {
        "__type__": "exception",
        "type": payload.safe_text(type(exc).__qualname__),
        "message": message,
        "traceback": tb,
    }


def as_reward(value: Any) -> float | None:
    """A number as the reward column's float (NaN and ±inf also from their JSON form's marker)."""
    if isinstance(value, dict) and value.get(payload.MARKER) == "float":
        with contextlib.suppress(payload.NotExact):
            value = payload.from_json(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return None
    return None
