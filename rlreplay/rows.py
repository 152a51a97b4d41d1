"""Span rows: turning a finished call (a queue event) into a row of the span schema, and batching rows."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from rlreplay import payload
from rlreplay.schema import KIND_TRAJECTORY, SPAN_SCHEMA, STATUS_ERROR, STATUS_OK

COLUMN_NAMES = tuple(SPAN_SCHEMA.names)

Warn = Callable[[str, str], None]  # (key, message): warn once per key


class StepBuffer:
    """Rows of one step waiting to be written, column by column, and the step's live file."""

    __slots__ = ("columns", "first_at", "nbytes", "open", "root_ended", "rows", "writer")

    def __init__(self) -> None:
        self.columns: list[list] = [[] for _ in COLUMN_NAMES]
        self.rows = 0
        self.nbytes = 0
        self.first_at = 0.0
        self.root_ended = False
        self.open = 0
        self.writer: Any = None  # the step's PartialWriter, owned by the recorder

    def append(self, row: tuple, nbytes: int) -> None:
        if not self.rows:
            self.first_at = time.monotonic()
        for column, value in zip(self.columns, row):
            column.append(value)
        self.rows += 1
        self.nbytes += nbytes

    def take_batch(self) -> pa.RecordBatch:
        batch = pa.RecordBatch.from_arrays(
            [pa.array(values, type=f.type) for values, f in zip(self.columns, SPAN_SCHEMA)],
            schema=SPAN_SCHEMA,
        )
        for values in self.columns:
            values.clear()
        self.rows = self.nbytes = 0
        self.root_ended = False
        return batch


def encode_row(
    event: tuple,
    config: Any,
    worker: str,
    warn: Warn,
    trajectory_id: Callable[[int], str],
    span_id_of: Callable[[int], str],
) -> tuple[tuple, int]:
    """The span's row, in SPAN_SCHEMA column order, and its approximate encoded size.

    ``config`` carries ``experiment`` and ``max_field_bytes``; ``trajectory_id``/``span_id_of``
    format the process-local counters as ids.
    """
    _, traj, span_id, parent_id, meta, start, end, exc, args, kwargs, result, _nbytes = event
    cap = config.max_field_bytes
    if meta.kind == KIND_TRAJECTORY:
        inputs_text, inputs_data = None, None
    else:
        inputs_obj = meta.bind(args, kwargs)
        if meta.reduce_inputs is not None:
            inputs_obj = _reduce(meta, "reduce_inputs", meta.reduce_inputs, inputs_obj, warn)
        inputs_data = payload.to_jsonable(inputs_obj)
        inputs_text = payload.dumps(inputs_data, cap)
    reward = None
    if exc is not None:
        output_data = exception_data(exc)
        error = f"{output_data['type']}: {output_data['message']}"
    else:
        out = result
        if meta.reduce_output is not None:
            out = _reduce(meta, "reduce_output", meta.reduce_output, result, warn)
        output_data = payload.to_jsonable(out) if out is not None else None
        error = None
        if meta.reward is not None:
            value = _reduce(meta, "reward", meta.reward, result, warn)
            reward = as_reward(value)
        elif isinstance(output_data, dict):
            reward = as_reward(output_data.get("reward_score", output_data.get("reward")))
    output_text = payload.dumps(output_data, cap) if output_data is not None else None
    attributes = (
        payload.dumps(payload.to_jsonable(traj.attributes)) if traj.attributes and parent_id is None else None
    )
    row = (
        trajectory_id(traj.id),
        span_id_of(span_id),
        None if parent_id is None else span_id_of(parent_id),
        meta.name,
        meta.kind,
        start,
        end,
        STATUS_OK if exc is None else STATUS_ERROR,
        error,
        traj.step,
        traj.sample_index,
        traj.rollout_n,
        traj.validate,
        traj.experiment or config.experiment,
        worker,
        reward,
        payload.count_token_ids(inputs_data) + payload.count_token_ids(output_data),
        attributes,
        inputs_text,
        output_text,
    )
    return row, 200 + len(inputs_text or "") + len(output_text or "")


def _reduce(meta: Any, what: str, fn: Callable[[Any], Any], value: Any, warn: Warn) -> Any:
    """A user-supplied reducer's result; if it raises, an error marker (the span is kept)."""
    try:
        return fn(value)
    except Exception as exc:
        message = f"{what} of {meta.name} raised {type(exc).__name__}: {exc}"
        warn(f"reduce:{meta.name}:{what}", message)
        return None if what == "reward" else {"__type__": "error", "error": message[:2000]}


def exception_data(exc: BaseException) -> dict[str, str]:
    try:
        message = str(exc)
    except Exception:
        message = "<str() failed>"
    try:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:
        tb = ""
    return {"__type__": "exception", "type": type(exc).__qualname__, "message": message, "traceback": tb}


def as_reward(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
