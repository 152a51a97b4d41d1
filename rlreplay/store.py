"""Reading a run: filters, the trajectory listing, and one trajectory's span tree."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlreplay import arrow_ops as ops
from rlreplay import index as tindex
from rlreplay import manifest, payload
from rlreplay.schema import (
    FORMAT_VERSION,
    KEY_STR,
    KEYS,
    PAYLOAD_COLUMNS,
    SIGNAL_COLUMNS,
    SPAN_SCHEMA,
    TOKEN_COLUMNS,
    V1_COLUMNS,
    FormatError,
    file_version,
    upgrade,
)
from rlreplay.shards import SPANS_DIR, list_files, read_partial, step_dirs

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

    def apply(self, table: pa.Table, id_column: str = "trajectory_id") -> pa.Table:
        """Rows of ``table`` that pass every filter (plain compute kernels: no dataset machinery).

        A key filter value matches the int column when it is an integer, else the ``_str`` column.
        """
        mask = None
        for key, values in self.items():
            if key in KEYS:
                term = _key_term(table, key, values)
            else:
                column = table[id_column if key == "trajectory_id" else key]
                term = ops.is_in(column, pa.array(values, type=column.type))
            term = ops.fill_null(term, False)
            mask = term if mask is None else ops.and_(mask, term)
        return table if mask is None else ops.filter(table, mask)

    def single_step(self) -> int | None:
        """The step's partition when the step filter is one integer."""
        if isinstance(self.step, (list, tuple, set, frozenset)):
            return None
        return _as_key_int(self.step)


def _key_term(table: pa.Table, key: str, values: list[Any]) -> Any:
    ints, strs = [], []
    for value in values:
        number = _as_key_int(value)
        if number is not None:
            ints.append(number)
        if isinstance(value, str) or (number is None and value is not None):
            strs.append(str(value))
    term = ops.is_in(table[key], pa.array(ints, type=pa.int64()))
    if strs and KEY_STR[key] in table.column_names:
        term = ops.or_(ops.fill_null(term, False), ops.is_in(table[KEY_STR[key]], pa.array(strs)))
    return term


def _as_key_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value) if value.strip().lstrip("-").isdigit() else None
        except ValueError:
            return None
    try:
        return int(value.__index__())
    except (AttributeError, TypeError, ValueError):
        return None


def key_value(int_value: int | None, str_value: str | None) -> int | str | None:
    """The one value of a key (step, sample_index, rollout_n) stored as an int and a string column."""
    return int_value if int_value is not None else str_value


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
        }
        for s in traj.spans
    ]
    schema = pa.schema([SPAN_SCHEMA.field(c) for c in tindex.SPAN_COLUMNS])
    return pa.Table.from_pylist(rows, schema=schema)


def _build_tree(spans: list[Span]) -> None:
    by_id = {s.span_id: s for s in spans}
    for span in spans:
        parent = by_id.get(span.parent_id) if span.parent_id else None
        if parent is not None:
            parent.children.append(span)


_SPAN_SCALARS = (*SIGNAL_COLUMNS[1:], "prompt_tokens", "response_tokens")


def trajectory_from_table(table: pa.Table, warn: Any = None) -> Trajectory:
    """One trajectory's spans (all rows share a trajectory_id, format 2 columns) as a tree.

    Token arrays go back where they were recorded, prefixes resolved; a payload that cannot be
    read becomes an ``error`` marker and is reported through ``warn(message)``.
    """
    import numpy as np

    table = ops.sort_by(table, [("start_ns", "ascending"), ("end_ns", "descending")]).combine_chunks()
    present = [c for c in TOKEN_COLUMNS if c in table.column_names]
    plain = [c for c in table.column_names if c not in TOKEN_COLUMNS]
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
    decoded: list[tuple[Any, Any, Any]] = []
    for r in rows:
        parts = []
        for name in ("inputs", "output", "attributes"):
            value, why = payload.decode_safe(r.get(name))
            if why:
                issues.append(f"span {r['span_id']}: {name}: {why}")
            parts.append(value)
        decoded.append(tuple(parts))  # type: ignore[arg-type]
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
        found = restorer.stream(decoded[i][0], cols, dtype) + restorer.stream(decoded[i][1], cols, dtype)
        found.sort(key=lambda p: p[0])
        stream = np.concatenate([a for _, a in found]) if found else None
        streams[key] = stream
        resolving.discard(key)
        return stream

    restorer = payload.Restorer(resolve)
    spans = []
    for i, r in enumerate(rows):
        cols = row_columns(i)
        inputs, output, attributes = decoded[i]
        if tokens:
            inputs = restorer.restore(inputs, cols)
            output = restorer.restore(output, cols)
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
                attributes=attributes if isinstance(attributes, dict) or attributes is None else None,
                **{c: r.get(c) for c in _SPAN_SCALARS},
            )
        )
    issues.extend(restorer.issues)
    if warn is not None and issues:
        warn(
            f"trajectory {rows[0]['trajectory_id'][:12]}: {issues[0]}"
            + (f" (+{len(issues) - 1} more)" if len(issues) > 1 else "")
        )
    _build_tree(spans)
    first = _owner_row(rows)
    meta_columns = [c for c in tindex.SPAN_COLUMNS if c in table.column_names]
    return Trajectory(
        id=first["trajectory_id"],
        **{k: key_value(first.get(k), first.get(KEY_STR[k])) for k in KEYS},
        validate=first["validate"],
        experiment=first["experiment"],
        worker=first["worker"],
        spans=spans,
        _meta=table.select(meta_columns) if len(meta_columns) == len(tindex.SPAN_COLUMNS) else None,
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
        if r["parent_id"] is None and r["kind"] != "signals":
            return r
    return rows[0]


@dataclass
class _File:
    path: Path
    sealed: bool
    index: pa.Table  # its index rows (row_groups set for sealed files)


class Run:
    """A recorded run directory. Corrupt or foreign files are skipped and listed in ``warnings``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.warnings: list[str] = []
        self.manifest = manifest.read_manifest(path, self.warnings)
        self._indexes: dict[Path, tuple[float, int, pa.Table]] = {}
        self._partials: dict[Path, tuple[float, int, pa.Table]] = {}
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

    def _skip(self, path: Path, exc: BaseException) -> None:
        self._warn(f"skipped unreadable file {path.relative_to(self.path)}: {_one_line(exc)}")

    # ---- files ------------------------------------------------------------------------------

    def _read_sealed(
        self,
        path: Path,
        filters: Filters,
        columns: list[str] | None,
        row_groups: list[int] | None = None,
    ) -> pa.Table | None:
        """Matching rows of one sealed file (format 2 columns), reading only the row groups that may
        match (``row_groups``, else those whose statistics do not exclude them)."""
        wanted = filters.items()
        source = self._sealed_source(
            path, whole=columns is None or any(c in PAYLOAD_COLUMNS for c in columns)
        )
        try:
            pf = pq.ParquetFile(source)
            version = file_version(pf.schema_arrow, "file")
            if row_groups is None:
                row_groups = [
                    i
                    for i in range(pf.num_row_groups)
                    if _row_group_may_match(pf.metadata.row_group(i), wanted)
                ]
            if not row_groups:
                return None
            need = None if columns is None else set(columns) | {k for k, _ in wanted}
            if need is not None and any(k in KEYS for k in need):
                need |= {KEY_STR[k] for k in KEYS if k in need}
            if need is not None and "trajectory_id" in need:
                need.add("trajectory_id")
            names = V1_COLUMNS if version == 1 else SPAN_SCHEMA.names
            read_cols = None if need is None else [c for c in names if c in need]
            table = pf.read_row_groups(row_groups, columns=read_cols)
            if version == 1:
                table = upgrade(table, [c for c in SPAN_SCHEMA.names if need is None or c in need])
        except (pa.ArrowException, OSError, FormatError) as exc:
            self._skip(path, exc)
            return None
        table = filters.apply(table)
        return table.select(columns) if columns is not None else table

    def _partial(self, path: Path) -> pa.Table | None:
        """A live file's rows (format 2 columns), cached while it does not change."""
        try:
            stat = path.stat()
            cached = self._partials.get(path)
            if cached is not None and cached[:2] == (stat.st_mtime, stat.st_size):
                return cached[2]
            table = read_partial(path).table
        except (pa.ArrowException, OSError, FormatError) as exc:
            self._skip(path, exc)
            return None
        self._partials[path] = (stat.st_mtime, stat.st_size, table)
        return table

    def _index(self, path: Path, sealed: bool) -> pa.Table | None:
        """A file's trajectory index: the sidecar of a sealed file, else built from its spans."""
        try:
            size, mtime_ns = self._stamp(path)
        except OSError as exc:
            self._skip(path, exc)
            return None
        cached = self._indexes.get(path)
        if cached is not None and cached[:2] == (mtime_ns, size):
            return cached[2]
        index = None
        if sealed:
            index = tindex.read(tindex.index_path(path), size)
            if index is None:
                index = self._build_index(path)
        else:
            table = self._partial(path)
            if table is not None:
                index = tindex.build(table.select(tindex.SPAN_COLUMNS))
        if index is not None:
            self._indexes[path] = (mtime_ns, size, index)
        return index

    def _stamp(self, path: Path) -> tuple[int, int]:
        """(bytes, mtime in ns) of a run file: what tells an index or a run index it is current."""
        stat = path.stat()
        return stat.st_size, stat.st_mtime_ns

    def _sealed_source(self, path: Path, whole: bool) -> Any:
        """What a sealed file is read from (a run on an object store fetches it first, or reads
        only some columns of it in place when not ``whole``)."""
        return path

    def _build_index(self, path: Path) -> pa.Table | None:
        """The index of a sealed file without one (format 1, or its index lost)."""
        import numpy as np

        source = self._sealed_source(path, whole=False)
        try:
            pf = pq.ParquetFile(source)
            version = file_version(pf.schema_arrow, "file")
            names = V1_COLUMNS if version == 1 else SPAN_SCHEMA.names
            cols = [c for c in names if c in tindex.SPAN_COLUMNS]
            table = pf.read(columns=cols)
            if version == 1:
                table = upgrade(table, tindex.SPAN_COLUMNS)
            sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
        except (pa.ArrowException, OSError, FormatError) as exc:
            self._skip(path, exc)
            return None
        groups = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
        return tindex.build(table.select(tindex.SPAN_COLUMNS), groups)

    def step_partitions(self) -> list[str]:
        """The values of the run's ``spans/step=*`` folders, as written (unsorted)."""
        return [d.name.removeprefix("step=") for d in step_dirs(self.path)]

    def _paths(self, filters: Filters) -> tuple[list[Path], list[Path]]:
        """(sealed files, live files) the filters may need: those of their steps, else all."""
        steps = filters.step if isinstance(filters.step, (list, tuple, set, frozenset)) else None
        if steps is None or not all(type(s) is int for s in steps):
            return list_files(self.path, filters.single_step())
        sealed: list[Path] = []
        partials: list[Path] = []
        for step in sorted(set(steps)):
            more = list_files(self.path, step)
            sealed += more[0]
            partials += more[1]
        return sealed, partials

    def _files(self, filters: Filters) -> list[_File]:
        sealed, partials = self._paths(filters)
        files = []
        for path, is_sealed in [(p, True) for p in sealed] + [(p, False) for p in partials]:
            index = self._index(path, is_sealed)
            if index is not None:
                files.append(_File(path, is_sealed, index))
        return files

    # ---- reading ----------------------------------------------------------------------------

    def spans(
        self, filters: Filters | None = None, columns: Sequence[str] | None = None, **kw: Any
    ) -> pa.Table:
        """Span rows matching the filters (keyword filters: step, sample_index, rollout_n, validate, ...)."""
        filters = filters or Filters(**kw)
        cols = list(columns) if columns is not None else None
        sealed, partials = self._paths(filters)
        tables = [t for t in (self._read_sealed(f, filters, cols) for f in sealed) if t is not None]
        for partial in partials:
            table = self._partial(partial)
            if table is None:
                continue
            table = filters.apply(table)
            tables.append(table.select(cols) if cols else table)
        return _concat(tables, cols)

    def index(self, filters: Filters | None = None, **kw: Any) -> pa.Table:
        """Merged index rows (one per trajectory) passing the filters."""
        filters = filters or Filters(**kw)
        if filters.step is None:
            return filters.apply(self._run_index(), id_column="id")
        rows = self._steps_index(filters)
        if rows is not None:
            return filters.apply(rows, id_column="id")
        files = self._files(filters)
        rows = (
            tindex.merge(pa.concat_tables([f.index for f in files]))
            if files
            else tindex.INDEX_SCHEMA.empty_table()
        )
        return filters.apply(rows, id_column="id")

    def _run_index(self) -> pa.Table:
        """Merged index rows of every trajectory: the run index file for the sealed shards it
        covers (brought up to date here), the index files of shards sealed since, and live files."""
        sealed, partials = self._paths(Filters())
        stamps: dict[str, list[int]] = {}
        for path in sealed:
            try:
                stamps[path.relative_to(self.path).as_posix()] = list(self._stamp(path))
            except OSError as exc:
                self._skip(path, exc)
                continue
        rows, covered, where, repair = self._read_run_index(stamps)
        added: dict[str, list[int]] = {}
        more = []
        for path in sealed:
            rel = path.relative_to(self.path).as_posix()
            if rel in stamps and rel not in covered:
                index = self._index(path, True)
                if index is not None:
                    more.append(index)
                    added[rel] = stamps[rel]
        rows = tindex.merge_into(rows, more)
        if (added or repair) and len(covered) + len(added) >= tindex.RUN_INDEX_MIN_SHARDS:
            self._write_run_index(rows, {**covered, **added}, where)
        live = [index for index in (self._index(path, False) for path in partials) if index is not None]
        return tindex.merge_into(rows, live)

    def _steps_index(self, filters: Filters) -> pa.Table | None:
        """Merged index rows of the filters' steps (integers) from the run index's row groups that
        hold them, the shards of these steps sealed since, and their live files; None when no run
        index covers these steps' shards as they are now."""
        single = filters.single_step()
        steps = [single] if single is not None else filters.step
        if not isinstance(steps, (list, tuple, set, frozenset)) or not all(type(s) is int for s in steps):
            return None
        candidates = []
        for where in tindex.run_index_paths(self.path):
            try:
                found = tindex.read_run_index(where, sorted(set(steps)))
            except ValueError:
                continue  # the whole-run listing reports it and writes a good one
            if found is not None:
                candidates.append(found)
        if not candidates:
            return None
        sealed, partials = self._paths(filters)
        stamps: dict[str, list[int]] = {}
        for path in sealed:
            try:
                stamps[path.relative_to(self.path).as_posix()] = list(self._stamp(path))
            except OSError:
                return None
        prefixes = tuple(f"{SPANS_DIR}/step={s}/" for s in steps)
        for rows, covered in candidates:
            mine = {rel: stamp for rel, stamp in covered.items() if rel.startswith(prefixes)}
            if any(stamps.get(rel) != stamp for rel, stamp in mine.items()):
                continue
            more = [self._index(p, True) for p in sealed if p.relative_to(self.path).as_posix() not in mine]
            live = [self._index(p, False) for p in partials]
            rows = tindex.merge_into(rows, [t for t in more if t is not None])
            return tindex.merge_into(rows, [t for t in live if t is not None])
        return None

    def _read_run_index(
        self, stamps: dict[str, list[int]]
    ) -> tuple[pa.Table, dict[str, list[int]], Path | None, bool]:
        """(rows, shards covered, its file, whether an unreadable one was met) of the run index
        covering the most shards, and only shards as they are now (``stamps``); else no rows."""
        repair = False
        best: tuple[pa.Table, dict[str, list[int]], Path | None] = (
            tindex.INDEX_SCHEMA.empty_table(),
            {},
            None,
        )
        for path in tindex.run_index_paths(self.path):
            try:
                found = tindex.read_run_index(path)
            except ValueError as exc:
                self._warn(f"ignored unreadable run index {path}: {_one_line(exc)} (rebuilding it)")
                repair = True
                continue
            if found is None or any(stamps.get(rel) != stamp for rel, stamp in found[1].items()):
                continue
            if len(found[1]) > len(best[1]):
                best = (found[0], found[1], None if repair else path)
            if len(best[1]) == len(stamps):
                break
        return (*best, repair)

    def _write_run_index(self, rows: pa.Table, covered: dict[str, list[int]], where: Path | None) -> None:
        """Save the run index where it was read, else in the run, else in the user's cache."""
        paths = tindex.run_index_paths(self.path)
        if where is not None:
            paths = [where] + [p for p in paths if p != where]
        for path in paths:
            try:
                tindex.write_run_index(rows, covered, path)
                return
            except (OSError, pa.ArrowException):
                continue

    def trajectories(self, filters: Filters | None = None, **kw: Any) -> pa.Table:
        """One row per trajectory (contract C2), sorted by step, sample_index, rollout_n, start.

        Read from the trajectory indexes, not the spans (a span-name filter reads span rows).
        """
        filters = filters or Filters(**kw)
        if filters.name is not None:
            return summarize(self.spans(filters, columns=tindex.SPAN_COLUMNS))
        return tindex.listing(self.index(filters))

    def resolve(self, ref: str) -> tuple[str, int | None]:
        """Full trajectory id and step for an id or a unique id prefix."""
        ref = ref.strip().lower()
        if not ref or any(c not in "0123456789abcdef" for c in ref):
            raise RunError(f"not a trajectory id: {ref!r} (expected hex characters)")
        table = self.index()
        matches = ops.filter(table, ops.starts_with(table["id"], ref))
        unique = sorted(set(matches["id"].to_pylist()))
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
        found = self.load([traj_id], Filters(step=step) if step is not None else None)
        if not found:
            raise RunError(f"no trajectory {ref!r} in {self.path}")
        traj = found[0]
        if text:
            from rlreplay.token2text import Decoder, add_text, resolve_tokenizer

            name = resolve_tokenizer(self, tokenizer)
            if name is None:
                raise RunError(f"no tokenizer is known for {self.path}; pass tokenizer='/path/to/dir'")
            add_text([traj], Decoder.load(name), skip_special_tokens=skip_special_tokens)
        return traj

    def load(self, traj_ids: Iterable[str], filters: Filters | None = None) -> list[Trajectory]:
        """Several trajectories at once, in the order given, reading only the row groups that hold them."""
        wanted = list(traj_ids)
        if not wanted:
            return []
        base = filters or Filters()
        base = Filters(**{**base.__dict__, "trajectory_id": wanted})
        wanted_set = pa.array(sorted(set(wanted)), type=pa.string())
        tables = []
        sources: dict[str, list[str]] = {}
        for f in self._files(base):
            hits = ops.filter(f.index, ops.is_in(f.index["id"], wanted_set))
            if hits.num_rows == 0:
                continue
            for tid in hits["id"].to_pylist():
                sources.setdefault(tid, []).append(str(f.path.relative_to(self.path)))
            if f.sealed:
                groups = sorted({g for gs in hits["row_groups"].to_pylist() if gs for g in gs})
                table = self._read_sealed(f.path, base, None, groups or None)
            else:
                table = self._partial(f.path)
                table = base.apply(table) if table is not None else None
            if table is not None and table.num_rows:
                tables.append(table)
        table = _concat(tables, None)
        groups: dict[str, list[int]] = {}
        for i, tid in enumerate(table["trajectory_id"].to_pylist()):
            groups.setdefault(tid, []).append(i)
        return [
            trajectory_from_table(
                ops.take(table, groups[t]), lambda m, t=t: self._warn(f"{', '.join(sources.get(t, []))}: {m}")
            )
            for t in wanted
            if t in groups
        ]

    def counters(self) -> dict[str, int]:
        """Spans dropped, spilled, lost or not encodable in the recording processes, and recoveries."""
        totals = manifest.total_counters(self.path, self.warnings)
        totals["recovered_shards"] = int(self.manifest.get("recovered_shards", 0) or 0)
        return totals


def summarize(spans: pa.Table) -> pa.Table:
    """The trajectory listing (contract C2) from span metadata rows: ``rlreplay.index`` rules."""
    if spans.num_rows == 0:
        return tindex.LISTING_SCHEMA.empty_table()
    missing = [c for c in tindex.SPAN_COLUMNS if c not in spans.column_names]
    if missing:
        for name in missing:
            spans = spans.append_column(
                SPAN_SCHEMA.field(name), pa.nulls(spans.num_rows, SPAN_SCHEMA.field(name).type)
            )
    return tindex.listing(tindex.merge(tindex.build(spans.select(tindex.SPAN_COLUMNS))))


TRAJECTORY_COLUMNS = [(f.name, f.type) for f in tindex.LISTING_FIELDS]


def listing_rows(table: pa.Table) -> list[dict[str, Any]]:
    """Listing rows as user-facing dicts: one merged value per key, no ``_str`` columns."""
    rows = table.to_pylist()
    for row in rows:
        for key in KEYS:
            row[key] = key_value(row.get(key), row.pop(KEY_STR[key], None))
    return rows


def _row_group_may_match(group: pq.RowGroupMetaData, wanted: list[tuple[str, list[Any]]]) -> bool:
    if not wanted:
        return True
    index = {group.column(i).path_in_schema: i for i in range(group.num_columns)}
    for key, values in wanted:
        if key in KEYS and any(_as_key_int(v) is None for v in values if v is not None):
            continue  # string keys live in the _str column
        stats = group.column(index[key]).statistics if key in index else None
        if stats is None or not stats.has_min_max:
            continue
        present = [v for v in values if v is not None]
        if key in KEYS:
            present = [_as_key_int(v) for v in present]
        try:
            if present and not any(stats.min <= v <= stats.max for v in present):
                return False
        except TypeError:
            continue
    return True


def _concat(tables: list[pa.Table], columns: list[str] | None) -> pa.Table:
    schema = pa.schema([SPAN_SCHEMA.field(c) for c in columns]) if columns else SPAN_SCHEMA
    tables = [ops.cast_table(t, schema) if t.schema != schema else t for t in tables]
    return pa.concat_tables(tables) if tables else schema.empty_table()


class _NoPandas:
    """An import finder refusing pandas (pyarrow then skips its pandas integration)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError("pandas is not used by rlreplay's reading commands", name=name)


def skip_pandas() -> None:
    """Keep pandas out of this process: pyarrow imports it on its first conversion (0.2–0.8 s),
    and reading a run never needs it. For the CLI's reading commands only (a process that may
    need pandas later must not call this)."""
    import sys

    if "pandas" not in sys.modules and not any(isinstance(f, _NoPandas) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoPandas())


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
    from rlreplay import storage

    uri = storage.as_uri(path if path is not None else os.environ.get("RLREPLAY_DIR"))
    if uri is not None:  # a run on an object store, read through a local cache
        return storage.open_remote(uri)
    run_path = storage.local_path(path) if path is not None else default_run_path()
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
