"""Trajectories as a dataset: one record per trajectory, messages in the OpenAI chat format.

Records hold the keys (merged as in ``ls --json``: a key with any non-int value is a string
column), ``validate``, ``experiment``, ``reward``, ``advantage`` (both from the listing) and
``messages`` from :func:`rlreplay.adapters.registry.openai_messages` (each with the same keys,
``role``, ``content``, ``tool_calls``, ``tool_call_id``, null where a message has none, so that every
record has one message type) and ``tools``, the tool schemas the prompt was rendered with (a JSON
array in a string: JSON Schema objects have a different shape per tool, which no one column type
holds; null when not recorded): ``apply_chat_template(messages, tools=json.loads(tools))``.
Per-token fields for RL datasets: with ``ids``, the agent span's ``prompt_ids``, ``response_ids``
and ``response_mask`` (1 = model token); with ``logprobs``, ``rollout_log_probs`` (the agent span's,
one per response token) and ``trainer_log_probs`` (the trainer's ``old_log_probs`` from its signals
span, when recorded). JSON lines and Parquet files load with the same types in ``datasets``,
DuckDB and polars (JSON has no int or float widths: 64 bits there). JSON has no NaN or infinity
either: JSON lines hold such a float as the format's ``float`` marker (``{"__type__": "float",
"value": "nan"}``; Parquet keeps it as it is).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from rlreplay.adapters.registry import adapter_for_run, openai_messages
from rlreplay.errors import NotExact
from rlreplay.format import payload as json_form
from rlreplay.format.index import merged
from rlreplay.format.keys import KEYS
from rlreplay.format.schema import KIND_AGENT, KIND_SIGNALS
from rlreplay.model import Trajectory
from rlreplay.read.filters import Filters
from rlreplay.read.run import Run

FORMATS = ("jsonl", "parquet")
RECORD_FIELDS = ("id", *KEYS, "validate", "experiment", "reward", "advantage")
ID_FIELDS = ("prompt_ids", "response_ids", "response_mask")
LOGPROB_FIELDS = ("rollout_log_probs", "trainer_log_probs")
#: The fields that hold floats (JSON lines write NaN and ±inf in them as markers).
FLOAT_FIELDS = ("reward", "advantage", *LOGPROB_FIELDS)
#: The trainer's per-token log-probs in its signals span (``record --token-signals``).
TRAINER_LOGPROBS = "old_log_probs"
#: Trajectories read (with payloads) at a time.
BATCH = 256

_CALL = pa.struct(
    [
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)
MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("tool_calls", pa.list_(_CALL)),
        ("tool_call_id", pa.string()),
    ]
)
MESSAGE_KEYS = tuple(f.name for f in MESSAGE)


def token_ids(traj: Trajectory) -> dict[str, list[int] | None]:
    """``prompt_ids``, ``response_ids``, ``response_mask`` as the agent span recorded them."""
    found: dict[str, list[int] | None] = dict.fromkeys(ID_FIELDS)
    for span in traj.by_kind(KIND_AGENT):
        for payload in (span.output, span.inputs):
            if not isinstance(payload, dict):
                continue
            for name in ID_FIELDS:
                value = payload.get(name)
                if found[name] is None and isinstance(value, list) and all(type(v) is int for v in value):
                    found[name] = value
    return found


def log_probs(traj: Trajectory, adapter: Any) -> dict[str, list[float] | None]:
    """``rollout_log_probs`` (the conversation's agent span, as its adapter names the field) and
    ``trainer_log_probs`` (the latest signals span's ``old_log_probs``), None where not recorded."""
    from rlreplay.text.conversation import ConversationFields, conversation_span, first_field

    fields = getattr(adapter, "fields", None) or ConversationFields()
    agent = conversation_span(traj, fields)
    rollout = (
        first_field(agent.output, fields.log_probs) if agent and isinstance(agent.output, dict) else None
    )
    trainer = None
    for span in sorted(traj.by_kind(KIND_SIGNALS), key=lambda s: s.end_ns, reverse=True):
        value = span.output.get(TRAINER_LOGPROBS) if isinstance(span.output, dict) else None
        if isinstance(value, list):
            trainer = value
            break
    return {"rollout_log_probs": _numbers(rollout), "trainer_log_probs": _numbers(trainer)}


def _numbers(values: Any) -> list[float] | None:
    """A recorded list of numbers as floats (NaN and ±inf from their markers); None when it is not one."""
    if not isinstance(values, list):
        return None
    try:
        out = json_form.from_json(values)
    except NotExact:
        return None
    if not all(type(v) in (int, float) for v in out):
        return None
    return [float(v) for v in out]


def _json_floats(value: Any) -> Any:
    """``value`` with each NaN or infinity as the format's ``float`` marker (JSON has neither)."""
    if type(value) is float:
        return value if math.isfinite(value) else json_form.float_marker(value)
    if type(value) is list:
        return [_json_floats(v) for v in value]
    return value


def _message(m: dict[str, Any]) -> dict[str, Any]:
    """A chat message with every key of :data:`MESSAGE` (null where it has none)."""
    return {name: m.get(name) for name in MESSAGE_KEYS}


def _tools_json(adapter: Any, traj: Trajectory) -> str | None:
    find = getattr(adapter, "tool_schemas", None)
    tools = find(traj) if callable(find) else None
    return None if tools is None else orjson.dumps(tools).decode()


def _batches(run: Run, listing: pa.Table, ids: list[str]) -> Iterator[list[Trajectory]]:
    """The trajectories ``ids`` (in that order), read a step at a time, ``BATCH`` at most."""
    step_of = dict(zip(listing["id"].to_pylist(), listing["step"].to_pylist()))
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]
        steps = sorted({step_of[i] for i in chunk if step_of.get(i) is not None})
        only_ints = all(step_of.get(i) is not None for i in chunk)
        filters = Filters(step=steps) if only_ints and steps else None
        loaded = {t.id: t for t in run.load(chunk, filters)}
        yield [loaded[i] for i in chunk if i in loaded]


def records(
    run: Run,
    listing: pa.Table,
    ids: list[str],
    decoder: Any,
    with_ids: bool = False,
    with_logprobs: bool = False,
) -> Iterator[list[dict[str, Any]]]:
    """Batches of export records for ``ids`` (rows of ``listing``), in the order of ``ids``."""
    adapter = adapter_for_run(run)
    shown = merged(listing)
    by_id = {row["id"]: row for row in shown.select(list(RECORD_FIELDS)).to_pylist()}
    for batch in _batches(run, listing, ids):
        out = []
        for traj in batch:
            record = dict(by_id[traj.id])
            record["messages"] = [_message(m) for m in openai_messages(traj, decoder, adapter)]
            record["tools"] = _tools_json(adapter, traj)
            if with_ids:
                record.update(token_ids(traj))
            if with_logprobs:
                record.update(log_probs(traj, adapter))
            out.append(record)
        yield out


def _json_line(record: dict[str, Any]) -> bytes:
    floats = {k: _json_floats(record[k]) for k in FLOAT_FIELDS if k in record}
    return orjson.dumps({**record, **floats}, option=orjson.OPT_NON_STR_KEYS) + b"\n"


def schema(listing: pa.Table, with_ids: bool, with_logprobs: bool = False) -> pa.Schema:
    """The Parquet schema of an export of ``listing``'s rows."""
    shown = merged(listing)
    fields = [shown.schema.field(name) for name in RECORD_FIELDS]
    fields += [pa.field("messages", pa.list_(MESSAGE)), pa.field("tools", pa.string())]
    if with_ids:
        fields += [
            pa.field("prompt_ids", pa.list_(pa.int32())),
            pa.field("response_ids", pa.list_(pa.int32())),
            pa.field("response_mask", pa.list_(pa.int8())),
        ]
    if with_logprobs:
        fields += [pa.field(name, pa.list_(pa.float32())) for name in LOGPROB_FIELDS]
    return pa.schema(fields)


def write(
    path: Path,
    fmt: str,
    run: Run,
    listing: pa.Table,
    ids: list[str],
    decoder: Any,
    with_ids: bool = False,
    progress: Callable[[int], None] | None = None,
    with_logprobs: bool = False,
    batches: Iterable[list[dict[str, Any]]] | None = None,
) -> int:
    """Write the records of ``ids`` to ``path`` as ``jsonl`` or ``parquet``; the number written.
    ``batches``: the records of ``ids`` made elsewhere (``--engine ray``), in their order."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    count = 0
    if batches is None:
        batches = records(run, listing, ids, decoder, with_ids, with_logprobs)
    if fmt == "jsonl":
        with open(path, "wb") as fh:
            for batch in batches:
                fh.write(b"".join(_json_line(r) for r in batch))
                count += len(batch)
                if progress is not None:
                    progress(count)
        return count
    import pyarrow.parquet as pq

    target = schema(listing, with_ids, with_logprobs)
    with pq.ParquetWriter(path, target, compression="zstd") as writer:
        for batch in batches:
            writer.write_table(pa.Table.from_pylist(batch, schema=target))
            count += len(batch)
            if progress is not None:
                progress(count)
    return count
