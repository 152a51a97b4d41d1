"""Reading a run one step at a time: the spans of chosen trajectories in one pass over the step's
shards, grouped by trajectory, and trajectories built from those groups."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from rlreplay.format import arrow_ops as ops
from rlreplay.model import Trajectory, trajectory_from_table
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


def by_step(listing: pa.Table) -> dict[Any, list[str]]:
    """The listing's trajectory ids by step (a step recorded as a string: its string)."""
    out: dict[Any, list[str]] = {}
    for tid, step, step_str in zip(*(listing[c].to_pylist() for c in ("id", "step", "step_str"))):
        out.setdefault(step if step is not None else step_str, []).append(tid)
    return out


def stream(run: Any, listing: pa.Table) -> Iterator[Trajectory]:
    """The listing's trajectories, step by step (one pass over each step's files; memory: one
    step's rows), in listing order within a step. A step that is not an integer is read
    trajectory by trajectory."""
    for step, ids in by_step(listing).items():
        if type(step) is not int:
            yield from run.load(ids)
            continue
        spans = step_spans(run, step, ids)
        warn = lambda message, step=step: run._warn(f"step {step}: {message}")  # noqa: E731
        for k in range(len(ids)):
            traj = spans.trajectory(k, warn)
            if traj is not None:
                yield traj
