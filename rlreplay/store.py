"""Reading a run: filters, the trajectory listing, and one trajectory's span tree."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from rlreplay import manifest, payload
from rlreplay.schema import (
    FORMAT_VERSION,
    KIND_AGENT,
    KIND_LLM,
    KIND_TOOL,
    KIND_TRAJECTORY,
    META_COLUMNS,
    SPAN_SCHEMA,
    STATUS_ERROR,
    FormatError,
    check_format,
)
from rlreplay.shards import SPANS_DIR, list_files, read_partial

RUNS_DIR = "rlreplay-runs"


class RunError(Exception):
    """Bad input when reading a run: a missing run, an unknown or ambiguous id, a bad filter."""


FilterValue = Any  # a value, or a sequence of values meaning "any of"


@dataclass
class Filters:
    step: FilterValue = None
    sample_index: FilterValue = None
    rollout_n: FilterValue = None
    validate: bool | None = None
    experiment: FilterValue = None
    name: FilterValue = None
    trajectory_id: FilterValue = None

    def expression(self) -> ds.Expression | None:
        expr = None
        for key in ("step", "sample_index", "rollout_n", "validate", "experiment", "name", "trajectory_id"):
            value = getattr(self, key)
            if value is None:
                continue
            if isinstance(value, (list, tuple, set, frozenset)):
                term = ds.field(key).isin(list(value))
            else:
                term = ds.field(key) == value
            expr = term if expr is None else expr & term
        return expr

    def single_step(self) -> int | None:
        return self.step if isinstance(self.step, int) and not isinstance(self.step, bool) else None


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

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def to_dict(self, nested: bool = True) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "children"}
        if nested:
            out["children"] = [c.to_dict() for c in self.children]
        return out


@dataclass
class Trajectory:
    id: str
    step: int | None
    sample_index: int | None
    rollout_n: int | None
    validate: bool | None
    experiment: str | None
    worker: str
    spans: list[Span]

    @property
    def roots(self) -> list[Span]:
        return [s for s in self.spans if s.parent_id is None or s.parent_id not in self._by_id]

    @property
    def _by_id(self) -> dict[str, Span]:
        return {s.span_id: s for s in self.spans}

    @property
    def start_ns(self) -> int:
        return min(s.start_ns for s in self.spans)

    @property
    def end_ns(self) -> int:
        return max(s.end_ns for s in self.spans)

    @property
    def status(self) -> str:
        return STATUS_ERROR if any(s.status == STATUS_ERROR for s in self.roots) else "ok"

    @property
    def reward(self) -> float | None:
        rewards = [
            s.reward for s in self.spans if s.reward is not None and s.kind in (KIND_TRAJECTORY, KIND_AGENT)
        ]
        return rewards[-1] if rewards else None

    @property
    def attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        for root in self.roots:
            attrs.update(root.attributes or {})
        attrs.update(
            step=self.step,
            sample_index=self.sample_index,
            rollout_n=self.rollout_n,
            validate=self.validate,
            experiment_name=self.experiment,
            worker=self.worker,
        )
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
            "spans": [root.to_dict() for root in self.roots],
        }


def _build_tree(spans: list[Span]) -> None:
    by_id = {s.span_id: s for s in spans}
    for span in spans:
        parent = by_id.get(span.parent_id) if span.parent_id else None
        if parent is not None:
            parent.children.append(span)


def trajectory_from_table(table: pa.Table) -> Trajectory:
    """One trajectory's spans (all rows share a trajectory_id) as a tree."""
    rows = table.sort_by([("start_ns", "ascending"), ("end_ns", "descending")]).to_pylist()
    spans = [
        Span(
            span_id=r["span_id"],
            parent_id=r["parent_id"],
            name=r["name"],
            kind=r["kind"],
            start_ns=r["start_ns"],
            end_ns=r["end_ns"],
            status=r["status"],
            error=r["error"],
            reward=r["reward"],
            num_tokens=r["num_tokens"],
            inputs=payload.decode(r["inputs"]),
            output=payload.decode(r["output"]),
            attributes=payload.decode(r["attributes"]),
        )
        for r in rows
    ]
    _build_tree(spans)
    first = rows[0]
    return Trajectory(
        id=first["trajectory_id"],
        step=first["step"],
        sample_index=first["sample_index"],
        rollout_n=first["rollout_n"],
        validate=first["validate"],
        experiment=first["experiment"],
        worker=first["worker"],
        spans=spans,
    )


class Run:
    """A recorded run directory. Corrupt or foreign files are skipped and listed in ``warnings``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest = manifest.read_manifest(path)
        self.warnings: list[str] = []
        version = self.manifest.get("format_version", FORMAT_VERSION)
        if int(version) > FORMAT_VERSION:
            raise RunError(
                f"{path}: recorded in format {version}, this rlreplay reads up to {FORMAT_VERSION}; "
                "upgrade rlreplay"
            )

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def experiment(self) -> str | None:
        return self.manifest.get("experiment")

    @property
    def tokenizer(self) -> str | None:
        return self.manifest.get("tokenizer")

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def _sealed_table(
        self, files: list[Path], expr: ds.Expression | None, columns: list[str] | None
    ) -> pa.Table:
        try:
            return ds.dataset([str(f) for f in files], schema=SPAN_SCHEMA, format="parquet").to_table(
                columns=columns, filter=expr
            )
        except (pa.ArrowException, OSError):
            pass
        good = []
        for f in files:
            try:
                check_format(pq.read_schema(f).metadata, "file")
                good.append(f)
            except (pa.ArrowException, OSError, FormatError) as exc:
                self._warn(f"skipped unreadable file {f.relative_to(self.path)}: {_one_line(exc)}")
        tables = []
        for f in good:  # one at a time so that a file broken past its footer is skipped too
            try:
                tables.append(
                    ds.dataset(str(f), schema=SPAN_SCHEMA, format="parquet").to_table(
                        columns=columns, filter=expr
                    )
                )
            except (pa.ArrowException, OSError) as exc:
                self._warn(f"skipped unreadable file {f.relative_to(self.path)}: {_one_line(exc)}")
        return _concat(tables, columns)

    def spans(
        self, filters: Filters | None = None, columns: Sequence[str] | None = None, **kw: Any
    ) -> pa.Table:
        """Span rows matching the filters (keyword filters: step, sample_index, rollout_n, validate, ...)."""
        filters = filters or Filters(**kw)
        cols = list(columns) if columns is not None else None
        sealed, partials = list_files(self.path, filters.single_step())
        expr = filters.expression()
        tables = [self._sealed_table(sealed, expr, cols)] if sealed else []
        for partial in partials:
            try:
                table = read_partial(partial).table
            except (pa.ArrowException, OSError, FormatError) as exc:
                self._warn(f"skipped unreadable file {partial.relative_to(self.path)}: {_one_line(exc)}")
                continue
            if expr is not None:
                table = ds.dataset(table).to_table(filter=expr)
            tables.append(table.select(cols) if cols else table)
        return _concat(tables, cols)

    def trajectories(self, filters: Filters | None = None, **kw: Any) -> pa.Table:
        """One row per trajectory, sorted by step, sample_index, rollout_n, start."""
        spans = self.spans(filters, columns=META_COLUMNS, **kw)
        return summarize(spans)

    def resolve(self, ref: str) -> tuple[str, int | None]:
        """Full trajectory id and step for an id or a unique id prefix."""
        ref = ref.strip().lower()
        if not ref or any(c not in "0123456789abcdef" for c in ref):
            raise RunError(f"not a trajectory id: {ref!r} (expected hex characters)")
        table = self.spans(columns=["trajectory_id", "step"])
        ids = table["trajectory_id"]
        mask = pc.starts_with(ids, ref)
        matches = table.filter(mask).group_by(["trajectory_id", "step"]).aggregate([])
        if matches.num_rows == 0:
            raise RunError(f"no trajectory {ref!r} in {self.path}")
        unique = sorted(set(matches["trajectory_id"].to_pylist()))
        if len(unique) > 1:
            shown = ", ".join(u[: len(ref) + 4] for u in unique[:5])
            raise RunError(f"ambiguous id prefix {ref!r}: matches {len(unique)} trajectories ({shown}...)")
        return unique[0], matches["step"][0].as_py()

    def trajectory(self, ref: str) -> Trajectory:
        """One trajectory, by id or unique prefix, with decoded inputs/outputs and its span tree."""
        traj_id, step = self.resolve(ref)
        table = self.spans(Filters(step=step, trajectory_id=traj_id))
        return trajectory_from_table(table)

    def load(self, traj_ids: Iterable[str], filters: Filters | None = None) -> list[Trajectory]:
        """Several trajectories at once, in the order given."""
        wanted = list(traj_ids)
        if not wanted:
            return []
        base = filters or Filters()
        table = self.spans(Filters(**{**base.__dict__, "trajectory_id": wanted}))
        groups: dict[str, list[int]] = {}
        for i, tid in enumerate(table["trajectory_id"].to_pylist()):
            groups.setdefault(tid, []).append(i)
        return [trajectory_from_table(table.take(groups[t])) for t in wanted if t in groups]

    def counters(self) -> dict[str, int]:
        """Spans dropped, spilled, lost or not encodable in the recording processes, and recoveries."""
        totals = manifest.total_counters(self.path)
        totals["recovered_shards"] = int(self.manifest.get("recovered_shards", 0) or 0)
        return totals


def summarize(spans: pa.Table) -> pa.Table:
    """The trajectory listing from span metadata rows."""
    if spans.num_rows == 0:
        return pa.table({name: pa.array([], type=typ) for name, typ in TRAJECTORY_COLUMNS})
    kind = spans["kind"]
    reward_kinds = pc.is_in(kind, pa.array([KIND_TRAJECTORY, KIND_AGENT]))
    work = spans.select(
        [
            "trajectory_id",
            "step",
            "sample_index",
            "rollout_n",
            "validate",
            "experiment",
            "worker",
            "start_ns",
            "end_ns",
        ]
    ).append_column("llm", pc.cast(pc.equal(kind, KIND_LLM), pa.int64()))
    work = work.append_column("tool", pc.cast(pc.equal(kind, KIND_TOOL), pa.int64()))
    work = work.append_column("agent_reward", pc.if_else(reward_kinds, spans["reward"], None))
    grouped = work.group_by("trajectory_id", use_threads=False).aggregate(
        [
            ("step", "min"),
            ("sample_index", "min"),
            ("rollout_n", "min"),
            ("validate", "max"),
            ("experiment", "min"),
            ("worker", "min"),
            ("start_ns", "min"),
            ("end_ns", "max"),
            ("trajectory_id", "count"),
            ("llm", "sum"),
            ("tool", "sum"),
            ("agent_reward", "max"),
        ]
    )
    is_root = pc.is_null(spans["parent_id"])
    roots = spans.filter(is_root).select(["trajectory_id", "span_id", "name", "status"])
    root_info = {
        tid: (name, status)
        for tid, name, status in zip(*(roots[c].to_pylist() for c in ("trajectory_id", "name", "status")))
    }
    root_ids = set(zip(roots["trajectory_id"].to_pylist(), roots["span_id"].to_pylist()))
    agent: dict[str, tuple[int, str]] = {}
    children = spans.filter(pc.invert(is_root)).select(["trajectory_id", "parent_id", "name", "start_ns"])
    for tid, parent, name, start in zip(*(children[c].to_pylist() for c in children.column_names)):
        if (tid, parent) in root_ids and (tid not in agent or start < agent[tid][0]):
            agent[tid] = (start, name)
    tids = grouped["trajectory_id"].to_pylist()
    starts = grouped["start_ns_min"].to_pylist()
    ends = grouped["end_ns_max"].to_pylist()
    names = [root_info.get(t, (None, "incomplete")) for t in tids]
    table = pa.table(
        {
            "id": tids,
            "step": grouped["step_min"],
            "sample_index": grouped["sample_index_min"],
            "rollout_n": grouped["rollout_n_min"],
            "validate": grouped["validate_max"],
            "experiment": grouped["experiment_min"],
            "worker": grouped["worker_min"],
            "name": [n for n, _ in names],
            "agent": [agent.get(t, (0, None))[1] for t in tids],
            "start_time": pa.array([s / 1e9 for s in starts], pa.float64()),
            "duration_s": pa.array([(e - s) / 1e9 for s, e in zip(starts, ends)], pa.float64()),
            "num_spans": grouped["trajectory_id_count"],
            "num_turns": grouped["llm_sum"],
            "num_tool_calls": grouped["tool_sum"],
            "status": [s for _, s in names],
            "reward": grouped["agent_reward_max"],
        }
    )
    return table.sort_by(
        [
            ("step", "ascending"),
            ("sample_index", "ascending"),
            ("rollout_n", "ascending"),
            ("start_time", "ascending"),
        ]
    )


TRAJECTORY_COLUMNS = [
    ("id", pa.string()),
    ("step", pa.int64()),
    ("sample_index", pa.int64()),
    ("rollout_n", pa.int64()),
    ("validate", pa.bool_()),
    ("experiment", pa.string()),
    ("worker", pa.string()),
    ("name", pa.string()),
    ("agent", pa.string()),
    ("start_time", pa.float64()),
    ("duration_s", pa.float64()),
    ("num_spans", pa.int64()),
    ("num_turns", pa.int64()),
    ("num_tool_calls", pa.int64()),
    ("status", pa.string()),
    ("reward", pa.float64()),
]


def _concat(tables: list[pa.Table], columns: list[str] | None) -> pa.Table:
    schema = pa.schema([SPAN_SCHEMA.field(c) for c in columns]) if columns else SPAN_SCHEMA
    tables = [t.cast(schema) if t.schema != schema else t for t in tables]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def default_run_path() -> Path:
    """``$RLREPLAY_DIR``, else the newest run under ``./rlreplay-runs/``."""
    env = os.environ.get("RLREPLAY_DIR")
    if env:
        return Path(env)
    base = Path(RUNS_DIR)
    runs = [p for p in base.iterdir() if p.is_dir()] if base.is_dir() else []
    if not runs:
        raise RunError(f"no run given and none found under ./{RUNS_DIR}/ (pass a run directory)")
    return max(runs, key=lambda p: p.stat().st_mtime)


def open_run(path: str | os.PathLike[str] | None = None) -> Run:
    """Open a recorded run directory (default: ``$RLREPLAY_DIR`` or the newest under ./rlreplay-runs/)."""
    run_path = Path(path) if path is not None else default_run_path()
    if not run_path.exists():
        raise RunError(f"no run at {run_path}")
    if not run_path.is_dir():
        raise RunError(f"{run_path} is not a directory")
    if not (run_path / manifest.MANIFEST).exists() and not (run_path / SPANS_DIR).is_dir():
        raise RunError(f"{run_path} is not an rlreplay run (no {manifest.MANIFEST} and no {SPANS_DIR}/)")
    try:
        return Run(run_path)
    except ValueError as exc:
        raise RunError(f"{run_path / manifest.MANIFEST}: unreadable ({exc})") from exc
