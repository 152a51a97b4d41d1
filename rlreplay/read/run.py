"""A recorded run, read through its store: its manifest, the trajectory listing, span reads and counters."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlreplay.errors import FormatError, RunError
from rlreplay.format import arrow_ops as ops
from rlreplay.format import index as tindex
from rlreplay.format import manifest, run_index
from rlreplay.format.checksums import CheckedParquet
from rlreplay.format.schema import (
    FORMAT_VERSION,
    KEY_STR,
    KEYS,
    PAYLOAD_COLUMNS,
    SPAN_SCHEMA,
    V1_COLUMNS,
    file_version,
    upgrade,
)
from rlreplay.model import Trajectory, trajectory_from_table
from rlreplay.read.filters import Filters, as_key_int
from rlreplay.read.store import LocalStore, Stamp, Store
from rlreplay.shards.layout import PARTIAL_SUFFIX, SEALED_SUFFIX, SPANS_DIR
from rlreplay.shards.lease import is_live
from rlreplay.shards.live import read_partial

RUNS_DIR = "rlreplay-runs"


@dataclass
class _File:
    path: Path
    sealed: bool
    index: pa.Table  # its index rows (row_groups set for sealed files)


class Run:
    """A recorded run: a run directory, or a :class:`Store` holding one (a run on an object store is
    read through ``rlreplay.read.remote.ObjectStore``). Corrupt or foreign files are skipped and
    listed in ``warnings``."""

    def __init__(self, source: str | os.PathLike[str] | Store) -> None:
        self.store: Store = LocalStore(source) if isinstance(source, (str, os.PathLike)) else source
        #: the local folder the run's files are read from (for a run on an object store, its cache)
        self.path = path = self.store.root
        self.warnings: list[str] = []
        #: span files (relative paths) read, those that could not be (and why), and those read
        #: without checksums (written before them)
        self.files_read: set[str] = set()
        self.unreadable: dict[str, str] = {}
        self.unverified: set[str] = set()
        #: (trajectory ids, owner) while reads keep to a part of a step: see :meth:`keep_to`
        self.scope: tuple[list[str], bool] | None = None
        self.manifest = manifest.read_manifest(path, self.warnings)
        self._indexes: dict[Path, tuple[float, int, pa.Table]] = {}
        self._segments: dict[Path, tuple[tuple[int, int], pa.Table]] = {}
        self._partials: dict[Path, tuple[float, int, pa.Table]] = {}
        version = self.manifest.get("format_version", FORMAT_VERSION)
        if int(version) > FORMAT_VERSION:
            raise RunError(
                f"{self.address}: recorded in format {version}, this rlreplay reads up to {FORMAT_VERSION}; "
                "upgrade rlreplay"
            )

    def __repr__(self) -> str:
        return f"Run({self.address!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def address(self) -> str:
        """Where the run is, as shown to a user: its directory (a URI for a run on an object store)."""
        return self.store.address

    @property
    def experiment(self) -> str | None:
        return self.manifest.get("experiment")

    @property
    def tokenizer(self) -> str | None:
        return self.manifest.get("tokenizer")

    def warn(self, message: str) -> None:
        """Add a line to ``warnings`` (once)."""
        if message not in self.warnings:
            self.warnings.append(message)

    def _skip(self, path: Path, exc: BaseException) -> None:
        """A span file this read could not read (damaged, foreign, gone): warned once, and counted
        in :meth:`incomplete`."""
        rel = self._relative(str(path))
        why = _one_line(exc).removeprefix(f"{rel}: ").removeprefix(f"{path}: ")
        self.unreadable.setdefault(rel, why)
        self.warn(f"skipped unreadable file {rel}: {why}")

    def notes(self) -> list[str]:
        """What a reading command says on stderr: every warning, then the line of
        :meth:`incomplete` when the reads left files out."""
        line = self.incomplete()
        return [*self.warnings, *([line] if line else [])]

    def incomplete(self) -> str | None:
        """One line saying that what was read of the run leaves files out, with counts (and what
        their index files say they hold); None when every span file read was read in full."""
        if not self.unreadable:
            return None
        tried = len(self.files_read | set(self.unreadable))
        spans = trajectories = 0
        known = 0
        for rel in self.unreadable:
            path = self.path / rel
            if not rel.endswith(SEALED_SUFFIX):
                continue
            try:
                index = tindex.read(tindex.index_path(path), self.store.stamp(path)[0])
            except OSError:
                index = None
            if index is not None:
                known += 1
                spans += int(ops.sum(index["num_spans"]).as_py() or 0)
                trajectories += index.num_rows
        held = ""
        if known:
            held = (
                f"; by {'their index files' if known > 1 else 'its index file'}"
                f"{'' if known == len(self.unreadable) else f' ({known} of them)'}: "
                f"{spans} spans of {trajectories} trajectories left out"
            )
        n = len(self.unreadable)
        return (
            f"{self.address} could not be read in full: {n} of the {tried} span files read "
            f"{'was' if n == 1 else 'were'} unreadable{held}"
        )

    # ---- files ------------------------------------------------------------------------------

    def _read_sealed(
        self,
        path: Path,
        filters: Filters,
        columns: list[str] | None,
        row_groups: list[int] | None = None,
        verify_all: bool = False,
    ) -> pa.Table | None:
        """Matching rows of one sealed file (format 2 columns), reading only the row groups that may
        match (``row_groups``, else those whose statistics do not exclude them); ``verify_all``:
        every row group's chunks of the columns read are verified first, as a read of them all
        would (a file damaged anywhere is skipped whichever rows are read of it)."""
        wanted = filters.items()
        try:
            with self._open_sealed(
                path, whole=columns is None or any(c in PAYLOAD_COLUMNS for c in columns)
            ) as pf:
                version = file_version(pf.schema_arrow, self._relative(str(path)))
                if row_groups is None:
                    row_groups = [
                        i
                        for i in range(pf.num_row_groups)
                        if _row_group_may_match(pf.metadata.row_group(i), wanted)
                    ]
                if not row_groups and not verify_all:
                    return None
                need = None if columns is None else set(columns) | {k for k, _ in wanted}
                if need is not None and any(k in KEYS for k in need):
                    need |= {KEY_STR[k] for k in KEYS if k in need}
                if need is not None and "trajectory_id" in need:
                    need.add("trajectory_id")
                names = V1_COLUMNS if version == 1 else SPAN_SCHEMA.names
                read_cols = None if need is None else [c for c in names if c in need]
                if verify_all:
                    pf.verify(None, read_cols)
                    if not row_groups:
                        return None
                table = pf.read_row_groups(row_groups, columns=read_cols)
            if version == 1:
                table = upgrade(table, [c for c in SPAN_SCHEMA.names if need is None or c in need])
            table = filters.apply(table)
        except (pa.ArrowException, OSError, FormatError, ValueError) as exc:
            self._skip(path, exc)
            return None
        return table.select(columns) if columns is not None else table

    def _open_sealed(self, path: Path, whole: bool) -> CheckedParquet:
        """A sealed file, opened with its footer verified (each column chunk is verified as it is
        read): made local first when it is read ``whole`` (payload columns), else read where it is
        (a run on an object store reads some columns of it in place). Every read of a sealed file
        opens it here."""
        if whole:
            self.store.make_local([path])
        rel = self._relative(str(path))
        self.files_read.add(rel)
        source = self.store.open_input(path)
        opened = CheckedParquet(source, rel, owned=True)
        if not opened.verified:
            self.unverified.add(rel)
        return opened

    def whole_shards(self, paths: Sequence[Path]) -> list[Path]:
        """The sealed shards among ``paths`` (local files) that are rlreplay span files matching
        their checksums in full, for a reader that reads them itself (a dataset scan); the
        others are skipped, as every read skips them."""
        good = []
        for path in paths:
            try:
                with self._open_sealed(path, whole=True) as pf:
                    file_version(pf.schema_arrow, self._relative(str(path)))
                    pf.verify()
            except (pa.ArrowException, OSError, FormatError, ValueError) as exc:
                self._skip(path, exc)
                continue
            good.append(path)
        return good

    def _partial(self, path: Path) -> pa.Table | None:
        """A live file's rows (format 2 columns), cached while it does not change. The whole
        batches of a file no writer holds any more and whose end is torn are read, and the file
        counted as not read in full."""
        rel = self._relative(str(path))
        self.files_read.add(rel)
        try:
            stat = path.stat()
            if stat.st_size == 0:  # just created, or the disk refused its first bytes: no rows
                return None
            cached = self._partials.get(path)
            if cached is not None and cached[:2] == (stat.st_mtime, stat.st_size):
                return cached[2]
            contents = read_partial(path)
            table = contents.table
            if not contents.verified:
                self.unverified.add(rel)
            if contents.discarded_bytes and not is_live(path):
                why = f"its last {contents.discarded_bytes} bytes are not a whole batch"
                self.unreadable.setdefault(rel, why)
                self.warn(
                    f"read the whole batches of {rel} only: {why} (its writer died mid-write; "
                    "`rlreplay recover` sets them aside)"
                )
        except (pa.ArrowException, OSError, FormatError, ValueError) as exc:
            self._skip(path, exc)
            return None
        self._partials[path] = (stat.st_mtime, stat.st_size, table)
        return table

    def _index(self, path: Path, sealed: bool) -> pa.Table | None:
        """A file's trajectory index: the sidecar of a sealed file, else built from its spans."""
        return self._indexes_of([path], sealed)[0]

    def _indexes_of(
        self, paths: Sequence[Path], sealed: bool, stamps: Sequence[tuple[int, int] | None] | None = None
    ) -> list[pa.Table | None]:
        """``_index`` of each file (None where unreadable); the sidecars not cached are read in a
        thread pool (pyarrow reads without the GIL), ``stamps`` are their (bytes, mtime in ns)
        when known."""
        found: list[pa.Table | None] = [None] * len(paths)
        todo: list[tuple[int, int, int]] = []  # (position, bytes, mtime_ns)
        for i, path in enumerate(paths):
            stamp = stamps[i] if stamps is not None else None
            if stamp is None:
                try:
                    stamp = self.store.stamp(path)
                except OSError as exc:
                    self._skip(path, exc)
                    continue
            size, mtime_ns = stamp
            cached = self._indexes.get(path)
            if cached is not None and cached[:2] == (mtime_ns, size):
                found[i] = cached[2]
            else:
                todo.append((i, size, mtime_ns))
        if sealed and todo:
            sidecars = [tindex.index_path(paths[i]) for i, _, _ in todo]
            self.store.make_local(sidecars)
            read = _map(lambda job: tindex.read(*job), [(f, t[1]) for f, t in zip(sidecars, todo)])
        else:
            read = [None] * len(todo)
        for (i, size, mtime_ns), index in zip(todo, read):
            path = paths[i]
            if index is None:
                index = self._build_index(path) if sealed else self._live_index(path)
            if index is not None:
                self._indexes[path] = (mtime_ns, size, index)
            found[i] = index
        return found

    def _live_index(self, path: Path) -> pa.Table | None:
        """The index of a live file, built from its spans."""
        table = self._partial(path)
        return tindex.build(table.select(tindex.JUDGED_COLUMNS)) if table is not None else None

    def _relative(self, name: str) -> str:
        """A run file's path (a string) relative to the run, with ``/``."""
        prefix = f"{self.path}/"
        return (
            name[len(prefix) :] if name.startswith(prefix) else Path(name).relative_to(self.path).as_posix()
        )

    def _build_index(self, path: Path) -> pa.Table | None:
        """The index of a sealed file without one (format 1, or its index lost)."""
        import numpy as np

        try:
            with self._open_sealed(path, whole=False) as pf:
                version = file_version(pf.schema_arrow, self._relative(str(path)))
                names = V1_COLUMNS if version == 1 else SPAN_SCHEMA.names
                cols = [c for c in names if c in tindex.JUDGED_COLUMNS]
                table = pf.read(columns=cols)
                sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
            if version == 1:
                table = upgrade(table, tindex.JUDGED_COLUMNS)
        except (pa.ArrowException, OSError, FormatError, ValueError) as exc:
            self._skip(path, exc)
            return None
        groups = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
        return tindex.build(table.select(tindex.JUDGED_COLUMNS), groups)

    def step_partitions(self) -> list[str]:
        """The values of the run's ``spans/step=*`` folders, as written (unsorted)."""
        return self.store.step_partitions()

    def file_signature(self) -> tuple[Any, ...]:
        """(name, bytes, mtime) of every span and counter file: changes whenever one is written
        (a run on an object store: its objects, listed, nothing fetched)."""
        return self.store.signature()

    def stored_bytes(self) -> int:
        """Bytes of the run's span files where the run is kept."""
        return self.store.stored_bytes()

    def fetch(self, step: int | None = None) -> None:
        """Make the shards of one step (or of every step) local (a run on an object store brings
        them into its cache; a run directory already is)."""
        self.span_files(step, fetch=True)

    def span_files(self, step: int | None = None, *, fetch: bool = False) -> tuple[list[Path], list[Path]]:
        """(sealed shards, live files) of one step (or of every step), as local paths; with
        ``fetch``, the shards are made local first (a run on an object store has them in its cache)."""
        sealed, live = self._paths(Filters(step=step))
        if fetch:
            self.store.make_local(sealed)
        return sealed, live

    def file_rows(self, path: str | os.PathLike[str]) -> pa.Table | None:
        """Every span row of one of the run's span files (sealed or live), in format 2 columns;
        None when it cannot be read (``warnings`` says why)."""
        path = Path(path)
        if path.name.endswith(PARTIAL_SUFFIX):
            return self._partial(path)
        return self._read_sealed(path, Filters(), None)

    def _names(self, filters: Filters) -> tuple[list[str], list[str]]:
        """(sealed files, live files) the filters may need, as path strings: those of their steps,
        else all."""
        steps = filters.step if isinstance(filters.step, (list, tuple, set, frozenset)) else None
        if steps is not None and all(type(s) is int for s in steps):
            return self.store.list_span_files(sorted(set(steps)))
        single = filters.single_step()
        return self.store.list_span_files(None if single is None else [single])

    def _paths(self, filters: Filters) -> tuple[list[Path], list[Path]]:
        """``_names`` as paths."""
        sealed, partials = self._names(filters)
        return [Path(p) for p in sealed], [Path(p) for p in partials]

    def _files(self, filters: Filters) -> list[_File]:
        sealed, partials = self._paths(filters)
        files = []
        for paths, is_sealed in ((sealed, True), (partials, False)):
            for path, index in zip(paths, self._indexes_of(paths, is_sealed)):
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
        if self.scope is not None and filters.trajectory_id is None:
            return self._scoped_spans(filters, cols, sealed, partials)
        if filters.trajectory_id is not None:  # a shard not local yet is read only when it may hold them
            far = [p for p in sealed if not self.store.is_local(p)]
            indexes = dict(zip(far, self._indexes_of(far, True)))  # their index files fetched at once
            ids = pa.array(dict(filters.items())["trajectory_id"], pa.string())
            sealed = [p for p in sealed if _may_hold(indexes.get(p), ids)]
        if cols is None or any(c in PAYLOAD_COLUMNS for c in cols):
            self.store.make_local(sealed)  # all at once (metadata columns alone are read in place)
        read = self._each(lambda path: self._read_sealed(path, filters, cols), sealed)
        tables = [t for t in read if t is not None]
        for partial in partials:
            table = self._partial(partial)
            if table is None:
                continue
            table = filters.apply(table)
            tables.append(table.select(cols) if cols else table)
        return concat_spans(tables, cols)

    def keep_to(self, ids: Sequence[str], owner: bool) -> None:
        """Reads of whole steps keep to trajectories ``ids`` (a part of a step): of each span file
        only the row groups holding them are read (per the file's index), every row group of the
        columns read still verified, so a file damaged anywhere is skipped as a whole read would
        skip it. The ``owner`` of a step (one part of it) also verifies the files that hold none
        of ``ids``, so each damaged file is warned about as a read of the whole step would."""
        self.scope = (list(ids), owner)

    def _scoped_spans(
        self, filters: Filters, cols: list[str] | None, sealed: list[Path], partials: list[Path]
    ) -> pa.Table:
        """``spans`` while reads keep to a part of a step (:meth:`keep_to`)."""
        assert self.scope is not None
        ids, owner = self.scope
        scoped = Filters(**{**filters.__dict__, "trajectory_id": ids})
        groups = self._groups_holding(sealed, pa.array(ids, pa.string()))
        chosen = [(p, g) for p, g in zip(sealed, groups) if owner or g != []]
        if cols is None or any(c in PAYLOAD_COLUMNS for c in cols):
            self.store.make_local([p for p, _ in chosen])
        read = self._each(lambda pair: self._read_sealed(pair[0], scoped, cols, pair[1], True), chosen)
        tables = [t for t in read if t is not None]
        for partial in partials:
            table = self._partial(partial)
            if table is not None:
                table = scoped.apply(table)
                tables.append(table.select(cols) if cols else table)
        return concat_spans(tables, cols)

    def _groups_holding(self, paths: Sequence[Path], ids: pa.Array) -> list[list[int] | None]:
        """Per sealed file, the row groups that hold rows of ``ids`` by its index file (None: not
        known; the file's row-group statistics then choose)."""
        out: list[list[int] | None] = []
        sidecars = [tindex.index_path(p) for p in paths]
        self.store.make_local(sidecars)
        for path, sidecar in zip(paths, sidecars):
            try:
                index = tindex.read(sidecar, self.store.stamp(path)[0])
            except OSError:
                index = None
            if index is None:
                out.append(None)
                continue
            hits = ops.filter(index, ops.is_in(index["id"], ids))
            held = hits["row_groups"].to_pylist()
            out.append(None if any(g is None for g in held) else sorted({g for gs in held for g in gs}))
        return out

    def index(self, filters: Filters | None = None, **kw: Any) -> pa.Table:
        """Merged index rows (one per trajectory) passing the filters."""
        filters = filters or Filters(**kw)
        single = filters.single_step()
        steps = [single] if single is not None else filters.step
        if filters.step is None or (
            isinstance(steps, (list, tuple, set, frozenset)) and all(type(s) is int for s in steps)
        ):
            sealed, partials = self._names(filters)
            rows = self._sealed_rows(sealed, None if filters.step is None else sorted(set(steps)))
            live = [
                index for index in self._indexes_of([Path(p) for p in partials], False) if index is not None
            ]
            return filters.apply(tindex.merge_into(rows, live), id_column="id")
        files = self._files(filters)
        rows = (
            tindex.merge(pa.concat_tables([f.index for f in files]))
            if files
            else tindex.INDEX_SCHEMA.empty_table()
        )
        return filters.apply(rows, id_column="id")

    def _each(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]``, as many at once as the store's reads pay off."""
        workers = min(self.store.concurrency, len(items))
        if workers < 2:
            return [fn(item) for item in items]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(fn, items))

    def _sealed_rows(self, sealed: Sequence[str], steps: Sequence[int] | None = None) -> pa.Table:
        """Merged index rows of the sealed shards ``sealed``: from the run index's segments that
        cover them as they are now, the rest from the shards' own index files. Listing the whole
        run (``steps`` None) saves those as new segments, merges small segments and removes
        segments that can never be used again."""
        stamps: run_index.Covered = {}
        names: dict[str, str] = {}
        for name in sealed:
            rel = self._relative(name)
            try:
                stamps[rel] = list(self.store.stamp(name))
            except OSError as exc:
                self._skip(Path(name), exc)
                continue
            names[rel] = name
        segments, unreadable = run_index.find(self.path)
        bad = [path for path, _ in unreadable]
        for path, why in unreadable:
            self.warn(f"ignored unreadable run index {path}: {why} (rebuilding it)")
        prefixes = None if steps is None else tuple(f"{SPANS_DIR}/step={s}/" for s in steps)
        used, unused = run_index.choose(segments, stamps, prefixes)
        rows_of: dict[Path, pa.Table] = {}
        for segment in used:
            try:
                rows = self._segment_rows(segment, steps)
            except ValueError as exc:
                self.warn(f"ignored unreadable run index {segment.path}: {_one_line(exc)} (rebuilding it)")
                bad.append(segment.path)
                continue
            if rows is not None:  # else merged into another meanwhile
                rows_of[segment.path] = rows
        read = [s for s in used if s.path in rows_of]
        done = run_index.covered_by(read, prefixes)
        todo = [rel for rel in stamps if rel not in done]
        save = steps is None and len(stamps) >= run_index.RUN_INDEX_MIN_SHARDS
        tables = list(rows_of.values())
        for at in range(0, len(todo), run_index.SEGMENT_MAX_SHARDS):
            chunk = todo[at : at + run_index.SEGMENT_MAX_SHARDS]
            indexes = self._indexes_of(
                [Path(names[r]) for r in chunk], True, [(stamps[r][0], stamps[r][1]) for r in chunk]
            )
            got = [(rel, index) for rel, index in zip(chunk, indexes) if index is not None]
            if not got:
                continue
            rows = tindex.merge(pa.concat_tables([index for _, index in got]))
            tables.append(rows)
            if save:
                segment = self._save_segment(rows, {rel: stamps[rel] for rel, _ in got})
                if segment is not None:
                    read.append(segment)
                    rows_of[segment.path] = rows
                    for rel, _ in got:
                        self._indexes.pop(Path(names[rel]), None)  # the segment holds them now
        if steps is None:  # keep only the rows of segments in use
            self._segments = {p: v for p, v in self._segments.items() if p in rows_of}
        if save:
            self._tidy(read, unused, bad, stamps, rows_of)
        return tindex.merge(pa.concat_tables(tables)) if tables else tindex.INDEX_SCHEMA.empty_table()

    def _segment_rows(self, segment: run_index.Segment, steps: Sequence[int] | None) -> pa.Table | None:
        """A segment's rows (all, or at least those of ``steps``), kept while its file is unchanged."""
        try:
            stamp = _local_stamp(segment.path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(_one_line(exc)) from exc
        cached = self._segments.get(segment.path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        rows = run_index.read_rows(segment, steps)
        if rows is not None and steps is None:
            self._segments[segment.path] = (stamp, rows)
        return rows

    def _save_segment(self, rows: pa.Table, covered: run_index.Covered) -> run_index.Segment | None:
        """Save rows as a new segment in the run, else in the user's cache; None when neither can be
        written."""
        for folder in run_index.folders(self.path):
            try:
                segment = run_index.write(rows, covered, folder)
            except (OSError, pa.ArrowException):
                continue
            self._segments[segment.path] = (_local_stamp(segment.path), rows)
            return segment
        return None

    def _tidy(
        self,
        read: list[run_index.Segment],
        unused: list[run_index.Segment],
        bad: list[Path],
        stamps: run_index.Covered,
        rows_of: dict[Path, pa.Table],
    ) -> None:
        """Remove the segments that can never be used again (unreadable, a shard of theirs changed
        or gone, every shard of theirs in a segment used), then merge small ones."""
        covered = run_index.covered_by(read)
        dead = list(bad)
        for segment in unused:
            if set(segment.covered) <= covered or any(
                (rel in stamps and stamps[rel] != stamp)
                or (rel not in stamps and not (self.path / rel).exists())
                for rel, stamp in segment.covered.items()
            ):
                dead.append(segment.path)
        for folder in run_index.folders(self.path):
            merging = run_index.to_merge([s for s in read if s.folder == folder])
            if not merging:
                continue
            rows = tindex.merge(pa.concat_tables([rows_of[s.path] for s in merging]))
            if self._save_segment(rows, {rel: v for s in merging for rel, v in s.covered.items()}):
                dead += [s.path for s in merging]
            break
        run_index.remove(dead)
        for path in dead:
            self._segments.pop(path, None)

    def trajectories(self, filters: Filters | None = None, **kw: Any) -> pa.Table:
        """One row per trajectory (contract C2), sorted by step, sample_index, rollout_n, start.

        Read from the trajectory indexes, not the spans (a span-name filter reads span rows).
        """
        filters = filters or Filters(**kw)
        if filters.name is not None:
            return tindex.summarize(self.spans(filters, columns=tindex.SPAN_COLUMNS))
        return tindex.listing(self.index(filters))

    def resolve(self, ref: str) -> tuple[str, int | None]:
        """Full trajectory id and step for an id or a unique id prefix."""
        ref = ref.strip().lower()
        if not ref or any(c not in "0123456789abcdef" for c in ref):
            raise RunError(f"not a trajectory id: {ref!r} (expected hex characters)")
        for step in set(run_index.steps_of(self.path, ref)):  # a whole id: its step's files tell
            if type(step) is int and self.index(Filters(step=step, trajectory_id=[ref])).num_rows:
                return ref, step
        table = self.index()
        matches = ops.filter(table, ops.starts_with(table["id"], ref))
        unique = sorted(set(matches["id"].to_pylist()))
        if not unique:
            raise RunError(f"no trajectory {ref!r} in {self.address}")
        if ref in unique:  # a whole id, even where it begins another
            return ref, ops.filter(matches, ops.equal(matches["id"], ref))["step"][0].as_py()
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
        if not found and self.unreadable:  # listed, but the file that holds it was refused
            raise RunError(f"trajectory {ref!r} cannot be read: {'; '.join(self.notes())}")
        if not found:
            raise RunError(f"no trajectory {ref!r} in {self.address}")
        traj = found[0]
        if text:
            from rlreplay.text.token2text import Decoder, add_text, resolve_tokenizer

            name = resolve_tokenizer(self, tokenizer)
            if name is None:
                raise RunError(f"no tokenizer is known for {self.address}; pass tokenizer='/path/to/dir'")
            add_text([traj], Decoder.load(name), skip_special_tokens=skip_special_tokens)
        return traj

    def load(
        self,
        traj_ids: Iterable[str],
        filters: Filters | None = None,
        kinds: Iterable[str] | None = None,
        skip_kinds: Iterable[str] = (),
    ) -> list[Trajectory]:
        """Several trajectories at once, in the order given, reading only the row groups that hold them;
        each holds only its spans of ``kinds`` (default: all) not in ``skip_kinds``: the others are
        decoded only where a chosen span's token array shares their values, so each span is as the
        whole trajectory holds it; a trajectory without spans of those kinds is left out."""
        wanted = list(traj_ids)
        if not wanted:
            return []
        base = filters or Filters()
        base = Filters(**{**base.__dict__, "trajectory_id": wanted})
        wanted_set = pa.array(sorted(set(wanted)), type=pa.string())
        tables = []
        sources: dict[str, list[str]] = {}
        holding = []
        for f in self._files(base):
            hits = ops.filter(f.index, ops.is_in(f.index["id"], wanted_set))
            if hits.num_rows:
                holding.append((f, hits))
        self.store.make_local([f.path for f, _ in holding if f.sealed])  # all at once
        for f, hits in holding:
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
        # one stable sort by id, then each trajectory's rows are a slice (one take per trajectory
        # over many files' chunks costs more than reading them)
        table = concat_spans(tables, None)
        table = ops.sort_by(table, [("trajectory_id", "ascending")]).combine_chunks()
        groups: dict[str, tuple[int, int]] = {}
        for i, tid in enumerate(table["trajectory_id"].to_pylist()):
            start, _ = groups.get(tid, (i, 0))
            groups[tid] = (start, i + 1 - start)
        chosen, skipped = None if kinds is None else set(kinds), set(skip_kinds)
        shown = None
        if chosen is not None or skipped:
            shown = lambda kind: (chosen is None or kind in chosen) and kind not in skipped  # noqa: E731
        found = [
            trajectory_from_table(
                table.slice(*groups[t]),
                lambda m, t=t: self.warn(f"{', '.join(sources.get(t, []))}: {m}"),
                shown,
            )
            for t in wanted
            if t in groups
        ]
        return found if shown is None else [t for t in found if t.spans]  # none of those kinds: none

    def counters(self) -> dict[str, int]:
        """Spans dropped, spilled, lost or not encodable in the recording processes, and recoveries
        (a run on an object store: its uploads' errors and what was left to upload, too)."""
        found = self.store.counters(self.warnings)
        totals = {name: found.pop(name, 0) for name in manifest.COUNTERS}
        totals["recovered_shards"] = int(self.manifest.get("recovered_shards", 0) or 0)
        return {**totals, **found}


def _may_hold(index: pa.Table | None, ids: pa.Array) -> bool:
    """Whether a file whose index is ``index`` (None: not known) may hold rows of trajectories ``ids``."""
    return index is None or bool(ops.sum(ops.is_in(index["id"], ids)).as_py())


def _local_stamp(path: Path) -> Stamp:
    """(bytes, mtime in ns) of a local file (a run index segment)."""
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def _map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[fn(x) for x in items]``, in a thread pool of one thread per core when there are many."""
    workers = min(os.cpu_count() or 1, len(items) // 64)
    if workers < 2:
        return [fn(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items, chunksize=64))


def _row_group_may_match(group: pq.RowGroupMetaData, wanted: list[tuple[str, list[Any]]]) -> bool:
    if not wanted:
        return True
    index = {group.column(i).path_in_schema: i for i in range(group.num_columns)}
    for key, values in wanted:
        if key in KEYS and any(as_key_int(v) is None for v in values if v is not None):
            continue  # string keys live in the _str column
        stats = group.column(index[key]).statistics if key in index else None
        if stats is None or not stats.has_min_max:
            continue
        present = [v for v in values if v is not None]
        if key in KEYS:
            present = [as_key_int(v) for v in present]
        try:
            if present and not any(stats.min <= v <= stats.max for v in present):
                return False
        except TypeError:
            continue
    return True


def concat_spans(tables: list[pa.Table], columns: list[str] | None) -> pa.Table:
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
