"""Span and Trajectory: what a run holds as readers see it, built from span rows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from rlreplay.format import arrays, json_lines, payload
from rlreplay.format import arrow_ops as ops
from rlreplay.format import index as tindex
from rlreplay.format.index import summarize
from rlreplay.format.keys import FIELDS, TrajectoryKey
from rlreplay.format.keys import stored_value as key_value  # the one value of a key (int, else _str)
from rlreplay.format.schema import (
    KEY_STR,
    KEYS,
    KIND_SIGNALS,
    KIND_TOOL,
    SIGNAL_COLUMNS,
    SPAN_SCHEMA,
    STATUS_ERROR,
    TOKEN_COLUMNS,
)
from rlreplay.format.tool_errors import returned_error


@dataclass
class Span:
    span_id: str
    parent_id: str | None
    name: str
    kind: str
    start_ns: int
    end_ns: int
    status: str
    error: str | None
    reward: float | None
    num_tokens: int | None
    inputs: Any
    output: Any
    attributes: dict[str, Any] | None
    children: list[Span] = field(default_factory=list)
    advantage: float | None = None
    logprob_diff_mean: float | None = None
    logprob_diff_max: float | None = None
    importance_ratio: float | None = None
    prompt_tokens: int | None = None
    response_tokens: int | None = None
    #: what the output's JSON form does not say: ``{JSON pointer: type}`` (``rlreplay.format.payload``),
    #: None for spans recorded before outputs had one
    output_type: dict[str, str] | None = None

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def to_dict(self, nested: bool = True) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "children"}
        if nested:
            out["children"] = [c.to_dict() for c in self.children]
        return out


#: The key's fields as trace attributes, by verl's names (``rollout_trace_attr``: ``experiment_name``).
KEY_ATTRIBUTES = tuple("experiment_name" if f == "experiment" else f for f in FIELDS)


#: The counts of a trajectory, one name and one meaning everywhere (``tool_errors``: ``format.tool_errors``).
COUNTS = ("model_calls", "tool_calls", "tool_errors")


@dataclass
class Trajectory:
    id: str
    step: int | str | None
    sample_index: int | str | None
    rollout_n: int | str | None
    validate: bool | None
    experiment: str | None
    worker: str
    spans: list[Span]
    _meta: pa.Table | None = field(default=None, repr=False, compare=False)
    _row: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> TrajectoryKey:
        """What names this trajectory across runs (its keys as recorded)."""
        return TrajectoryKey(*(getattr(self, f) for f in FIELDS))

    @property
    def roots(self) -> list[Span]:
        """Spans whose parent is not in the trajectory (normally the one root span)."""
        ids = {s.span_id for s in self.spans}
        return [s for s in self.spans if s.parent_id is None or s.parent_id not in ids]

    @property
    def timed(self) -> list[Span]:
        """The spans that make the trajectory's time: not the trainer's ``signals``, written later."""
        own = [s for s in self.spans if s.kind != KIND_SIGNALS]
        return own or self.spans

    @property
    def start_ns(self) -> int:
        return min(s.start_ns for s in self.timed)

    @property
    def end_ns(self) -> int:
        return max(s.end_ns for s in self.timed)

    @property
    def row(self) -> dict[str, Any]:
        """This trajectory's listing row (contract C2), by the rules of ``summarize``."""
        if self._row is None:
            self._row = trajectory_row(self)
        return self._row

    @property
    def status(self) -> str:
        return self.row["status"]

    @property
    def reward(self) -> float | None:
        return self.row["reward"]

    @property
    def counts(self) -> dict[str, int]:
        """:data:`COUNTS` by name: what every surface (listing, ``show``, ``diff``, uploads) calls them."""
        return {name: self.row[name] for name in COUNTS}

    @property
    def model_calls(self) -> int:
        """``llm`` spans, as the listing counts them."""
        return self.row["model_calls"]

    @property
    def tool_calls(self) -> int:
        return self.row["tool_calls"]

    @property
    def tool_errors(self) -> int:
        return self.row["tool_errors"]

    @property
    def attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        for root in self.roots:
            attrs.update(root.attributes or {})
        attrs.update(zip(KEY_ATTRIBUTES, (getattr(self, f) for f in FIELDS)))
        attrs["worker"] = self.worker
        return attrs

    def by_kind(self, kind: str) -> list[Span]:
        return [s for s in self.spans if s.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            **{k: v for k, v in self.attributes.items() if k != "experiment_name"},
            "experiment": self.experiment,
            "start_time": self.start_ns / 1e9,
            "duration_s": (self.end_ns - self.start_ns) / 1e9,
            "status": self.status,
            "reward": self.reward,
            "model_calls": self.model_calls,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "spans": [root.to_dict() for root in self.roots],
        }


def trajectory_row(traj: Trajectory) -> dict[str, Any]:
    """The C2 listing row of one trajectory (merged key values), computed by ``summarize``."""
    meta = traj._meta if traj._meta is not None else _meta_of(traj)
    rows = summarize(meta).to_pylist()
    row = rows[0] if rows else {}
    for key in KEYS:
        row[key] = key_value(row.get(key), row.pop(KEY_STR[key], None))
    return row


def trajectory_status(traj: Trajectory) -> str:
    """``incomplete`` without a root span, ``error`` if the root failed, else ``ok`` (C2)."""
    return traj.row["status"]


def _meta_of(traj: Trajectory) -> pa.Table:
    """Span metadata rows rebuilt from a trajectory's spans (one made in memory)."""
    keys = {}
    for key in KEYS:
        value = getattr(traj, key)
        keys[key] = value if isinstance(value, int) and not isinstance(value, bool) else None
        keys[KEY_STR[key]] = None if value is None or keys[key] is not None else str(value)
    rows = [
        {
            "trajectory_id": traj.id,
            "worker": traj.worker,
            "experiment": traj.experiment,
            "validate": traj.validate,
            **keys,
            **{c: getattr(s, c) for c in tindex.SPAN_COLUMNS if hasattr(s, c)},
            "error": _judged_error(s),
        }
        for s in traj.spans
    ]
    schema = pa.schema([SPAN_SCHEMA.field(c) for c in tindex.SPAN_COLUMNS])
    return pa.Table.from_pylist(rows, schema=schema)


def _judged_error(span: Span) -> str | None:
    """A span's error, and for a tool call that returned a failure, why (as the recorder writes it)."""
    if span.kind == KIND_TOOL and span.status != STATUS_ERROR and not span.error:
        return returned_error(span.output)
    return span.error


def _build_tree(spans: list[Span]) -> None:
    by_id = {s.span_id: s for s in spans}
    for span in spans:
        parent = by_id.get(span.parent_id) if span.parent_id else None
        if parent is not None:
            parent.children.append(span)


_SPAN_SCALARS = (*SIGNAL_COLUMNS[1:], "prompt_tokens", "response_tokens")


def trajectory_from_table(table: pa.Table, warn: Any = None, shown: Any = None) -> Trajectory:
    """One trajectory's spans (all rows share a trajectory_id, format 2 columns) as a tree.

    Token arrays go back where they were recorded, prefixes resolved; a payload that cannot be
    read becomes an ``error`` marker and is reported through ``warn(message)``. ``shown(kind)``
    (default: every kind) chooses the spans the trajectory holds; the others are decoded only
    where a token array of a chosen span shares their values, so a chosen span is exactly what
    the whole trajectory holds.
    """

    table = ops.sort_by(table, [("start_ns", "ascending"), ("end_ns", "descending")]).combine_chunks()
    names = table.column_names  # a new list each time it is asked for
    present = [c for c in TOKEN_COLUMNS if c in names]
    plain = [c for c in names if c not in TOKEN_COLUMNS]
    rows = table.select(plain).to_pylist()
    tokens: dict[str, tuple[Any, Any]] = {}
    for name in present:
        column = table[name]
        chunk = column.chunk(0) if column.num_chunks else pa.array([], column.type)
        offsets = chunk.offsets.to_numpy()
        values = chunk.values.to_numpy(zero_copy_only=False)
        tokens[name] = (offsets, values)

    def row_columns(i: int) -> dict[str, Any]:
        return {n: v[o[i] : o[i + 1]] for n, (o, v) in tokens.items()}

    issues: list[str] = []
    decoded: dict[int, tuple[Any, Any, Any]] = {}

    def payloads(i: int) -> tuple[Any, Any, Any]:
        """Row ``i``'s inputs, output and attributes, decoded once."""
        if i not in decoded:
            parts = []
            for name in ("inputs", "output", "attributes"):
                value, why = payload.decode_safe(rows[i].get(name))
                if why:
                    issues.append(f"span {rows[i]['span_id']}: {name}: {why}")
                parts.append(value)
            decoded[i] = (parts[0], parts[1], parts[2])
        return decoded[i]

    by_span = {r["span_id"]: i for i, r in enumerate(rows)}
    streams: dict[tuple[str, str], Any] = {}
    resolving: set[tuple[str, str]] = set()

    def resolve(span_id: str, dtype: str) -> Any:
        key = (span_id, dtype)
        if key in streams:
            return streams[key]
        i = by_span.get(span_id)
        if i is None or key in resolving:
            return None
        resolving.add(key)
        cols = row_columns(i)
        inputs, output, _ = payloads(i)
        stream = restorer.span_stream(inputs, output, cols, dtype)
        streams[key] = stream
        resolving.discard(key)
        return stream

    restorer = arrays.Restorer(resolve)
    spans = []
    for i, r in enumerate(rows):
        if shown is not None and not shown(r["kind"]):
            continue
        cols = row_columns(i)
        inputs, output, attributes = payloads(i)
        if tokens:
            inputs = restorer.restore(inputs, cols)
            output = restorer.restore(output, cols)
        if not isinstance(attributes, dict):
            attributes = None
        output_type = attributes.pop(payload.OUTPUT_TYPE, None) if attributes else None
        spans.append(
            Span(
                span_id=r["span_id"],
                parent_id=r["parent_id"],
                name=r["name"],
                kind=r["kind"],
                start_ns=r["start_ns"],
                end_ns=r["end_ns"],
                status=r["status"],
                error=r["error"],
                reward=r.get("reward"),
                num_tokens=r.get("num_tokens"),
                inputs=inputs,
                output=output,
                attributes=attributes or None,
                **{c: r.get(c) for c in _SPAN_SCALARS},
                output_type=output_type if isinstance(output_type, dict) else None,
            )
        )
    issues.extend(restorer.issues)
    report_issues(warn, rows[0]["trajectory_id"], issues)
    _build_tree(spans)
    meta_columns = [c for c in tindex.JUDGED_COLUMNS if c in names]
    meta = table.select(meta_columns) if set(tindex.SPAN_COLUMNS) <= set(meta_columns) else None
    return trajectory_of(_owner_row(rows), spans, meta)


def trajectory_of(owner: dict[str, Any], spans: list[Span], meta: pa.Table | None = None) -> Trajectory:
    """The trajectory of ``spans``, its id and keys from its owner row (the root span's)."""
    return Trajectory(
        id=owner["trajectory_id"],
        **{k: key_value(owner.get(k), owner.get(KEY_STR[k])) for k in KEYS},
        validate=owner["validate"],
        experiment=owner["experiment"],
        worker=owner["worker"],
        spans=spans,
        _meta=meta,
    )


def report_issues(warn: Any, trajectory_id: str, issues: list[str]) -> None:
    """Tell ``warn`` (when given) the first of a trajectory's unreadable payloads, and how many more."""
    if warn is not None and issues:
        warn(
            f"trajectory {trajectory_id[:12]}: {issues[0]}"
            + (f" (+{len(issues) - 1} more)" if len(issues) > 1 else "")
        )


def decoded_rows(spans: pa.Table, warn: Any = None) -> list[dict[str, Any]]:
    """Span rows (all columns) as dicts with ``inputs``/``output``/``attributes`` decoded and token
    arrays restored; the typed token columns are dropped."""
    out: list[dict[str, Any]] = []
    if spans.num_rows == 0:
        return out
    groups: dict[str, list[int]] = {}
    for i, tid in enumerate(spans["trajectory_id"].to_pylist()):
        groups.setdefault(tid, []).append(i)
    plain = [c for c in spans.column_names if c not in TOKEN_COLUMNS]
    for rows in groups.values():
        part = ops.take(spans, rows)
        traj = trajectory_from_table(part, warn)
        by_id = {s.span_id: s for s in traj.spans}
        for r in part.select(plain).to_pylist():
            span = by_id[r["span_id"]]
            r.update(inputs=span.inputs, output=span.output, attributes=span.attributes)
            out.append(r)
    return out


def _owner_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The root span's row (it carries the trajectory's worker), else the first."""
    for r in rows:
        if r["parent_id"] is None and r["kind"] != KIND_SIGNALS:
            return r
    return rows[0]


TRAJECTORY_COLUMNS = [(f.name, f.type) for f in tindex.LISTING_FIELDS]


def listing_rows(table: pa.Table) -> list[dict[str, Any]]:
    """Listing rows as user-facing dicts: one merged value per key, no ``_str`` columns."""
    rows = table.to_pylist()
    for row in rows:
        for key in KEYS:
            row[key] = key_value(row.get(key), row.pop(KEY_STR[key], None))
    return rows


def listing_json(
    table: pa.Table, extra: dict[str, list[Any]] | None = None, chunk: int = 65536, threads: int = 1
) -> Iterator[str]:
    """:func:`listing_rows` as JSON lines (the bytes ``orjson.dumps`` gives row by row), with the
    ``extra`` columns (one value per row) after them, in slices of ``chunk`` rows; column-wise.
    ``threads``: how many slices are made at once (in order; Arrow's kernels, which do most of the
    work, leave the interpreter lock)."""
    names = table.column_names

    def lines(start: int, length: int) -> str:
        part = table.slice(start, length)
        columns = []
        for name in names:
            if name in KEY_STR.values():
                continue
            values = json_lines.texts(part[name])
            if name in KEY_STR and KEY_STR[name] in names:
                values = ops.coalesce(values, json_lines.texts(part[KEY_STR[name]]))
            columns.append((name, values))
        for key in KEYS:
            if key not in names:
                strings = part[KEY_STR[key]] if KEY_STR[key] in names else pa.nulls(length)
                columns.append((key, json_lines.texts(strings)))
        for name, values in (extra or {}).items():
            columns.append((name, json_lines.encode(values[start : start + length])))
        return json_lines.lines(columns)

    slices = list(json_lines.chunks(table.num_rows, chunk))
    if threads <= 1 or len(slices) <= 1:
        for start, length in slices:
            yield lines(start, length)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="rlreplay-json") as pool:
        made: deque[Any] = deque()
        for start, length in slices:  # at most ``threads`` slices made ahead of the one written
            made.append(pool.submit(lines, start, length))
            if len(made) > threads:
                yield made.popleft().result()
        while made:
            yield made.popleft().result()
