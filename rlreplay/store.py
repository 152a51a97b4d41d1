"""Reading a run: filters, the trajectory listing, and one trajectory's span tree."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
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
FILTER_KEYS = ("step", "sample_index", "rollout_n", "validate", "experiment", "name", "trajectory_id")


@dataclass
class Filters:
    step: FilterValue = None
    sample_index: FilterValue = None
    rollout_n: FilterValue = None
    validate: bool | None = None
    experiment: FilterValue = None
    name: FilterValue = None
    trajectory_id: FilterValue = None

    def items(self) -> list[tuple[str, list[Any]]]:
        """(column, allowed values) for every filter that is set."""
        out = []
        for key in FILTER_KEYS:
            value = getattr(self, key)
            if value is not None:
                out.append(
                    (key, list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value])
                )
        return out

    def apply(self, table: pa.Table) -> pa.Table:
        """Rows of ``table`` that pass every filter (plain compute kernels: no dataset machinery)."""
        mask = None
        for key, values in self.items():
            column = table[key]
            term = pc.is_in(column, value_set=pa.array(values, type=column.type))
            mask = term if mask is None else pc.and_(mask, term)
        return table if mask is None else table.filter(mask)

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
        """Spans whose parent is not in the trajectory (normally the one root span)."""
        ids = {s.span_id for s in self.spans}
        return [s for s in self.spans if s.parent_id is None or s.parent_id not in ids]

    @property
    def start_ns(self) -> int:
        return min(s.start_ns for s in self.spans)

    @property
    def end_ns(self) -> int:
        return max(s.end_ns for s in self.spans)

    def _rule(self) -> tuple[float | None, str]:
        table = pa.table(
            {
                "kind": pa.array([s.kind for s in self.spans], pa.string()),
                "parent_id": pa.array([s.parent_id for s in self.spans], pa.string()),
                "status": pa.array([s.status for s in self.spans], pa.string()),
                "reward": pa.array([s.reward for s in self.spans], pa.float64()),
                "end_ns": pa.array([s.end_ns for s in self.spans], pa.int64()),
            }
        )
        import numpy as np

        rewards, statuses = reward_and_status(table, np.zeros(len(self.spans), np.int64), 1)
        return (None if np.isnan(rewards[0]) else float(rewards[0])), statuses[0].as_py()

    @property
    def status(self) -> str:
        """``incomplete`` without a root span, else ``error`` or ``ok`` (see ``reward_and_status``)."""
        return self._rule()[1]

    @property
    def reward(self) -> float | None:
        """The reward the listing shows (see ``reward_and_status``)."""
        return self._rule()[0]

    @property
    def model_calls(self) -> int:
        return sum(1 for s in self.spans if s.kind == KIND_LLM)

    @property
    def tool_calls(self) -> int:
        return sum(1 for s in self.spans if s.kind == KIND_TOOL)

    @property
    def tool_errors(self) -> int:
        return sum(1 for s in self.spans if s.kind == KIND_TOOL and s.status == STATUS_ERROR)

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
            "model_calls": self.model_calls,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "spans": [root.to_dict() for root in self.roots],
        }


#: Span kind of rows another process (the trainer, the reward loop) adds to a trajectory.
KIND_SIGNALS = "signals"
STATUS_INCOMPLETE = "incomplete"
_REWARD_PRIORITY = {KIND_SIGNALS: 2, KIND_AGENT: 1, KIND_TRAJECTORY: 1}


def reward_and_status(spans: pa.Table, group: Any, n: int) -> tuple[Any, pa.Array]:
    """The one rule for a trajectory's reward and status, over span rows grouped by ``group``
    (trajectory number 0..n-1 of each row; columns kind, parent_id, status, reward, end_ns).

    reward: of the latest-ending ``signals`` span with a reward, else of the latest-ending
    ``agent`` or ``trajectory`` span with one (tool rewards never count); NaN when none.
    status: ``incomplete`` when the root span (no parent, not ``signals``) is missing, else
    ``error`` when it failed, else ``ok``.
    """
    import numpy as np

    group = np.asarray(group, dtype=np.int64)
    kind = spans["kind"]
    priority = np.zeros(len(group), dtype=np.int64)
    for name, rank in _REWARD_PRIORITY.items():
        priority[pc.fill_null(pc.equal(kind, name), False).to_numpy(zero_copy_only=False)] = rank
    reward_values = pc.fill_null(spans["reward"], np.nan).to_numpy(zero_copy_only=False)
    eligible = np.nonzero((priority > 0) & ~np.isnan(reward_values))[0]
    reward = np.full(n, np.nan)
    if len(eligible):
        end = spans["end_ns"].to_numpy(zero_copy_only=False)[eligible]
        order = eligible[np.lexsort((end, priority[eligible], group[eligible]))]
        last = np.append(group[order][1:] != group[order][:-1], True)
        reward[group[order][last]] = reward_values[order][last]

    is_root = pc.and_(pc.is_null(spans["parent_id"]), pc.not_equal(kind, KIND_SIGNALS))
    is_root = pc.fill_null(is_root, False).to_numpy(zero_copy_only=False)
    failed = pc.fill_null(pc.equal(spans["status"], STATUS_ERROR), False).to_numpy(zero_copy_only=False)
    has_root = np.bincount(group[is_root], minlength=n) > 0
    root_failed = np.bincount(group[is_root & failed], minlength=n) > 0
    status = np.where(has_root, np.where(root_failed, STATUS_ERROR, "ok"), STATUS_INCOMPLETE)
    return reward, pa.array(status.tolist(), pa.string())


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

    def _read_sealed(self, path: Path, filters: Filters, columns: list[str] | None) -> pa.Table | None:
        """Matching rows of one sealed file, skipping row groups whose statistics exclude them."""
        wanted = filters.items()
        try:
            pf = pq.ParquetFile(path)
            if SPAN_SCHEMA.names != pf.schema_arrow.names:
                check_format(pf.schema_arrow.metadata, "file")
                raise FormatError("not an rlreplay span file (unexpected columns)")
            groups = [
                i for i in range(pf.num_row_groups) if _row_group_may_match(pf.metadata.row_group(i), wanted)
            ]
            if not groups:
                return None
            read_cols = None if columns is None else sorted(set(columns) | {k for k, _ in wanted})
            table = pf.read_row_groups(groups, columns=read_cols)
        except (pa.ArrowException, OSError, FormatError) as exc:
            self._warn(f"skipped unreadable file {path.relative_to(self.path)}: {_one_line(exc)}")
            return None
        table = filters.apply(table)
        return table.select(columns) if columns is not None else table

    def spans(
        self, filters: Filters | None = None, columns: Sequence[str] | None = None, **kw: Any
    ) -> pa.Table:
        """Span rows matching the filters (keyword filters: step, sample_index, rollout_n, validate, ...)."""
        filters = filters or Filters(**kw)
        cols = list(columns) if columns is not None else None
        sealed, partials = list_files(self.path, filters.single_step())
        tables = [t for t in (self._read_sealed(f, filters, cols) for f in sealed) if t is not None]
        for partial in partials:
            try:
                table = read_partial(partial).table
            except (pa.ArrowException, OSError, FormatError) as exc:
                self._warn(f"skipped unreadable file {partial.relative_to(self.path)}: {_one_line(exc)}")
                continue
            table = filters.apply(table)
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
        matches = table.filter(pc.starts_with(table["trajectory_id"], ref))
        unique = sorted(set(matches["trajectory_id"].to_pylist()))
        if not unique:
            raise RunError(f"no trajectory {ref!r} in {self.path}")
        if len(unique) > 1:
            shown = ", ".join(u[: len(ref) + 4] for u in unique[:5])
            raise RunError(f"ambiguous id prefix {ref!r}: matches {len(unique)} trajectories ({shown}...)")
        return unique[0], matches["step"][0].as_py()

    def trajectory(
        self, ref: str, text: bool = False, tokenizer: str | None = None, skip_special_tokens: bool = False
    ) -> Trajectory:
        """One trajectory, by id or unique prefix: its span tree with inputs and outputs as recorded
        (token ids). With ``text=True`` the ids are also decoded (``prompt_text``,
        ``response_text``, the agent's ``conversation``) with ``tokenizer`` or the run's own."""
        traj_id, step = self.resolve(ref)
        table = self.spans(Filters(step=step, trajectory_id=traj_id))
        traj = trajectory_from_table(table)
        if text:
            from rlreplay.token2text import Decoder, add_text, resolve_tokenizer

            name = resolve_tokenizer(self, tokenizer)
            if name is None:
                raise RunError(f"no tokenizer is known for {self.path}; pass tokenizer='/path/to/dir'")
            add_text([traj], Decoder.load(name), skip_special_tokens=skip_special_tokens)
        return traj

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
    """The trajectory listing from span metadata rows (numpy segment reductions, no query engine)."""
    import numpy as np

    if spans.num_rows == 0:
        return pa.table({name: pa.array([], type=typ) for name, typ in TRAJECTORY_COLUMNS})
    spans = spans.combine_chunks()
    encoded = pc.dictionary_encode(spans["trajectory_id"]).chunk(0)
    group = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    ids = encoded.dictionary
    n = len(ids)
    _, first_row = np.unique(group, return_index=True)
    kind = spans["kind"]

    def count(mask: pa.ChunkedArray) -> np.ndarray:
        return np.bincount(group, weights=mask.to_numpy(zero_copy_only=False), minlength=n).astype(np.int64)

    start = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(start, group, spans["start_ns"].to_numpy())
    end = np.full(n, np.iinfo(np.int64).min)
    np.maximum.at(end, group, spans["end_ns"].to_numpy())
    reward, statuses = reward_and_status(spans, group, n)

    is_root = pc.is_null(spans["parent_id"]).to_numpy(zero_copy_only=False)
    root_rows = np.full(n, -1)
    root_rows[group[is_root]] = np.nonzero(is_root)[0]
    has_root = root_rows >= 0
    root_take = pa.array(np.where(has_root, root_rows, 0))
    names = pc.if_else(pa.array(has_root), spans["name"].take(root_take), None)
    root_span = spans["span_id"].take(root_take).take(pa.array(group))
    child_of_root = pc.and_(pc.equal(spans["parent_id"], root_span), pa.array(has_root[group]))
    children = np.nonzero(pc.fill_null(child_of_root, False).to_numpy(zero_copy_only=False))[0]
    agent = [None] * n
    if len(children):
        order = children[np.argsort(spans["start_ns"].to_numpy()[children], kind="stable")]
        groups_of, first = np.unique(group[order], return_index=True)
        for g, name in zip(groups_of, spans["name"].take(pa.array(order[first])).to_pylist()):
            agent[g] = name

    firsts = spans.select(["step", "sample_index", "rollout_n", "validate", "experiment", "worker"]).take(
        pa.array(first_row)
    )
    table = pa.table(
        {
            "id": ids,
            "step": firsts["step"],
            "sample_index": firsts["sample_index"],
            "rollout_n": firsts["rollout_n"],
            "validate": firsts["validate"],
            "experiment": firsts["experiment"],
            "worker": firsts["worker"],
            "name": names,
            "agent": pa.array(agent, pa.string()),
            "start_time": pa.array(start / 1e9),
            "duration_s": pa.array((end - start) / 1e9),
            "num_spans": pa.array(np.bincount(group, minlength=n).astype(np.int64)),
            "num_turns": pa.array(count(pc.equal(kind, KIND_LLM))),
            "num_tool_calls": pa.array(count(pc.equal(kind, KIND_TOOL))),
            "status": statuses,
            "reward": pa.array(reward, from_pandas=True),
        }
    )
    return table.cast(pa.schema(TRAJECTORY_COLUMNS)).sort_by(
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


def _row_group_may_match(group: pq.RowGroupMetaData, wanted: list[tuple[str, list[Any]]]) -> bool:
    if not wanted:
        return True
    index = {group.column(i).path_in_schema: i for i in range(group.num_columns)}
    for key, values in wanted:
        stats = group.column(index[key]).statistics if key in index else None
        if stats is None or not stats.has_min_max:
            continue
        present = [v for v in values if v is not None]
        try:
            if present and not any(stats.min <= v <= stats.max for v in present):
                return False
        except TypeError:
            continue
    return True


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
