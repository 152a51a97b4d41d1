"""Reading a run one step at a time: the spans of chosen trajectories in one pass over the step's
shards, grouped by trajectory, and trajectories built from those groups."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rlreplay.format import arrow_ops as ops
from rlreplay.format.schema import KEY_STR, KEYS
from rlreplay.model import Span, Trajectory, report_issues, trajectory_from_table, trajectory_of
from rlreplay.read.filters import Filters

#: the column holding each row's trajectory's position in the ids asked for
POSITION = "_position"


@dataclass
class StepSpans:
    """Span rows of ``ids`` in one step, grouped in the order of ``ids`` (rows of ``ids[i]`` from
    ``starts[i]`` to ``starts[i + 1]``), ordered by start time then name inside a group."""

    ids: list[str]
    table: pa.Table
    starts: Any  # numpy int64, len(ids) + 1

    def rows(self, i: int) -> pa.Table:
        return self.table.slice(int(self.starts[i]), int(self.starts[i + 1] - self.starts[i]))

    def trajectory(self, i: int, warn: Any = None) -> Trajectory | None:
        """Trajectory ``ids[i]`` built from its rows, or None when it has none in this step."""
        rows = self.rows(i)
        return trajectory_from_table(rows.drop_columns([POSITION]), warn) if rows.num_rows else None


def step_spans(run: Any, step: int, ids: Sequence[str], columns: Sequence[str] | None = None) -> StepSpans:
    """The rows of trajectories ``ids`` in ``step`` (``columns`` of them, ``trajectory_id``,
    ``start_ns`` and ``name`` among them; default all), read in one pass over the step's files."""
    import numpy as np

    wanted = pa.array(list(ids), pa.string())
    table = run.spans(Filters(step=step), columns=list(columns) if columns is not None else None)
    position = ops.index_in(table["trajectory_id"], wanted)
    keys = pa.table({POSITION: position, "start_ns": table["start_ns"], "name": table["name"]})
    order = ops.sort_indices(
        keys, [(POSITION, "ascending"), ("start_ns", "ascending"), ("name", "ascending")]
    )
    found = len(position) - position.null_count
    order = order.slice(0, found)  # nulls sort last: the rows of other trajectories
    table = ops.take(table.append_column(POSITION, position), order).combine_chunks()
    counts = (
        np.bincount(table[POSITION].to_numpy(), minlength=len(ids)) if found else np.zeros(len(ids), np.int64)
    )
    return StepSpans(list(ids), table, np.r_[0, np.cumsum(counts)])


def step_rows(listing: pa.Table) -> list[tuple[Any, Any]]:
    """(step, the positions of its rows) for each step of ``listing``, in the order steps first
    appear (a step recorded as a string: its string); the positions as numpy int64, ascending."""
    import numpy as np

    step = listing["step"]
    if step.null_count == len(step):
        ints = np.zeros(0, np.int64)
        known = np.zeros(0, np.int64)
    else:
        valid = ops.is_valid(step).to_numpy(zero_copy_only=False)
        known = np.flatnonzero(valid)
        ints = ops.fill_null(step, 0).to_numpy(zero_copy_only=False)[known]
    order = np.argsort(ints, kind="stable")
    values, starts = np.unique(ints[order], return_index=True)
    groups: list[tuple[Any, Any, int]] = [
        (int(v), rows, int(rows[0]))
        for v, rows in zip(values, np.split(known[order], starts[1:]) if len(order) else [])
    ]
    if len(known) < listing.num_rows:  # steps recorded as strings: few rows, grouped here
        others: dict[Any, list[int]] = {}
        unknown = np.setdiff1d(np.arange(listing.num_rows), known)
        for row, name in zip(unknown.tolist(), ops.take(listing["step_str"], unknown).to_pylist()):
            others.setdefault(name, []).append(row)
        groups += [(name, np.array(rows, np.int64), rows[0]) for name, rows in others.items()]
    groups.sort(key=lambda g: g[2])
    return [(s, rows) for s, rows, _ in groups]


def by_step(listing: pa.Table) -> dict[Any, list[str]]:
    """The listing's trajectory ids by step (:func:`step_rows`), in listing order within a step."""
    ids = listing["id"]
    return {step: ops.take(ids, rows).to_pylist() for step, rows in step_rows(listing)}


def stream(run: Any, listing: pa.Table) -> Iterator[Trajectory]:
    """The listing's trajectories, step by step (one pass over each step's files; memory: one
    step's rows), in listing order within a step. A step that is not an integer is read
    trajectory by trajectory."""
    for step, ids in by_step(listing).items():
        if type(step) is not int:
            yield from run.load(ids)
            continue
        spans = step_spans(run, step, ids)
        warn = lambda message, step=step: run.warn(f"step {step}: {message}")  # noqa: E731
        for k in range(len(ids)):
            traj = spans.trajectory(k, warn)
            if traj is not None:
                yield traj


#: the columns ``step_calls`` reads
CALL_COLUMNS = (
    "trajectory_id",
    "span_id",
    "parent_id",
    "name",
    "kind",
    "start_ns",
    "end_ns",
    "status",
    "error",
    "worker",
    "experiment",
    "validate",
    *KEYS,
    *(KEY_STR[k] for k in KEYS),
    "inputs",
    "output",
    "token_ids",
)


def step_calls(run: Any, step: int, ids: Sequence[str], kinds: Sequence[str], warn: Any = None) -> StepCalls:
    """Trajectories ``ids`` of ``step`` holding only their spans of ``kinds``, read in one pass
    over the step's files and built one at a time (see ``StepCalls.trajectory``)."""
    return StepCalls(run.spans(Filters(step=step), columns=list(CALL_COLUMNS)), ids, set(kinds), warn)


class StepCalls:
    """One step's span rows for ``step_calls``: grouped by trajectory, the rows of the kinds
    wanted as Python values, the others decoded only where a token array refers to them."""

    def __init__(self, table: pa.Table, ids: Sequence[str], kinds: set[str], warn: Any = None) -> None:
        import numpy as np

        self.table = table
        self.warn = warn
        self.group_of: dict[int, int] = {}
        if not table.num_rows:
            self.groups: list[range] = []
            self.who: list[dict[str, Any]] = []
            return
        position = ops.fill_null(ops.index_in(table["trajectory_id"], pa.array(list(ids), pa.string())), -1)
        self.pos = pos = position.to_numpy()
        keys = pa.table(
            {"p": position, "start_ns": table["start_ns"], "end_ns": table["end_ns"], "name": table["name"]}
        )
        # as trajectory_from_table orders a trajectory's rows: by start, the longer span first, by name
        order = ops.sort_indices(
            keys,
            [("p", "ascending"), ("start_ns", "ascending"), ("end_ns", "descending"), ("name", "ascending")],
        ).to_numpy()
        self.order = order = order[pos[order] >= 0]
        cuts = [0, *(np.flatnonzero(np.diff(pos[order])) + 1).tolist(), len(order)]
        self.groups = [range(a, b) for a, b in itertools.pairwise(cuts) if b > a]
        taken = pa.array(order)
        self.span_ids = ops.take(table["span_id"], taken).to_pylist()
        self.kinds = ops.take(table["kind"], taken).to_pylist()
        self.parents = ops.take(table["parent_id"], taken).to_pylist()
        self.kept = [j for j, k in enumerate(self.kinds) if k in kinds]
        self.at = {j: k for k, j in enumerate(self.kept)}
        plain = ["name", "start_ns", "end_ns", "status", "error", "inputs", "output"]
        kept_rows = pa.array(order[self.kept]) if self.kept else pa.array([], pa.int64())
        self.cols = {c: ops.take(table[c], kept_rows).to_pylist() for c in plain}
        chunk = table["token_ids"].combine_chunks()
        self.offsets, self.values = chunk.offsets.to_numpy(), chunk.values.to_numpy(zero_copy_only=False)
        self.who = self.owners()
        self.group_of = {int(pos[order[g.start]]): i for i, g in enumerate(self.groups)}

    def owners(self) -> list[dict[str, Any]]:
        """Per group, its owner row's identity (the root span's row, else the first)."""
        owners = []
        for g in self.groups:
            j = next((j for j in g if self.parents[j] is None and self.kinds[j] != "signals"), g.start)
            owners.append(int(self.order[j]))
        names = ["trajectory_id", "worker", "experiment", "validate", *KEYS, *(KEY_STR[k] for k in KEYS)]
        return ops.take(self.table.select(names), pa.array(owners, pa.int64())).to_pylist()

    def tokens(self, row: int) -> dict[str, Any]:
        return {"token_ids": self.values[self.offsets[row] : self.offsets[row + 1]]}

    def trajectory(self, k: int) -> Trajectory | None:
        """Trajectory ``ids[k]`` holding only its spans of the kinds asked for (no tree, no
        attributes, token id arrays of 64 ids or more as numpy arrays, other arrays left as their
        placeholders), or None when it has no rows in this step."""
        i = self.group_of.get(k)
        return self._build(self.groups[i], self.who[i], self.warn) if i is not None else None

    def _build(self, group: range, who: dict[str, Any], warn: Any) -> Trajectory:

        from rlreplay.format import payload
        from rlreplay.format.arrays import IdRestorer

        by_span = {self.span_ids[j]: j for j in group}
        decoded: dict[int, tuple[Any, Any]] = {}
        streams: dict[tuple[str, str], Any] = {}
        issues: list[str] = []

        def payloads(j: int) -> tuple[Any, Any]:
            """Row ``j``'s inputs and output, decoded once."""
            if j not in decoded:
                k = self.at.get(j)
                parts = []
                for name in ("inputs", "output"):
                    text = (
                        self.cols[name][k] if k is not None else self.table[name][int(self.order[j])].as_py()
                    )
                    value, why = payload.decode_safe(text)
                    if why:
                        issues.append(f"span {self.span_ids[j]}: {name}: {why}")
                    parts.append(value)
                decoded[j] = (parts[0], parts[1])
            return decoded[j]

        def resolve(span_id: str, dtype: str) -> Any:
            j, key = by_span.get(span_id), (span_id, dtype)
            if j is None or key in streams:
                return streams.get(key)
            streams[key] = None  # a reference circle resolves to nothing
            inputs, output = payloads(j)
            cols = self.tokens(int(self.order[j]))
            streams[key] = restorer.span_stream(inputs, output, cols, dtype)
            return streams[key]

        restorer = IdRestorer(resolve)
        spans = []
        for j in group:
            k = self.at.get(j)
            if k is None:
                continue
            inputs, output = payloads(j)
            cols = self.tokens(int(self.order[j]))
            spans.append(
                Span(
                    span_id=self.span_ids[j],
                    parent_id=self.parents[j],
                    name=self.cols["name"][k],
                    kind=self.kinds[j],
                    start_ns=self.cols["start_ns"][k],
                    end_ns=self.cols["end_ns"][k],
                    status=self.cols["status"][k],
                    error=self.cols["error"][k],
                    reward=None,
                    num_tokens=None,
                    inputs=restorer.restore(inputs, cols),
                    output=restorer.restore(output, cols),
                    attributes=None,
                )
            )
        issues.extend(restorer.issues)
        restorer.resolve = None  # no reference circle: the step's rows go once it is done with
        report_issues(warn, who["trajectory_id"], issues)
        return trajectory_of(who, spans)
