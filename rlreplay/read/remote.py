"""A run on an object store, read through the local cache: listings fetch index files, reads fetch shards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rlreplay.errors import RunError, StorageError
from rlreplay.format import manifest
from rlreplay.format.index import INDEX_SUFFIX, index_path
from rlreplay.format.schema import PAYLOAD_COLUMNS
from rlreplay.read.filters import Filters
from rlreplay.read.run import Run, concat_spans
from rlreplay.remote.cache import Cache, is_cached
from rlreplay.remote.location import (
    Location,
    bucket_exists,
    error_line,
    exists,
    is_object_store,
    list_dirs,
    list_objects,
    location,
    redact,
)
from rlreplay.shards.layout import SEALED_SUFFIX, SPANS_DIR


def open_remote(uri: str) -> Any:
    """A :class:`rlreplay.read.run.Run` over a run URI, reading through a local cache."""
    try:
        loc = location(uri)
        cache = Cache(loc)
        has_manifest = cache.fetch_manifest()
        if not has_manifest and not list_objects(loc, SPANS_DIR):
            bucket = loc.root.split("/", 1)[0]
            if is_object_store(loc.fs) and not exists(loc, "") and not bucket_exists(loc, bucket):
                raise RunError(f"no bucket {bucket!r} at {redact(uri)} (or no access to it)")
            raise RunError(f"no run at {redact(uri)} (no {manifest.MANIFEST} and no {SPANS_DIR}/)")
        return RemoteRun(loc, cache)
    except StorageError as exc:
        raise RunError(str(exc)) from exc
    except OSError as exc:
        raise RunError(f"{redact(uri)}: {error_line(exc)}") from exc


class RemoteRun(Run):
    """A run on an object store, read through a local cache. Listings fetch each shard's index
    file only (and keep a run index in the cache); span reads fetch the shards they read."""

    def __init__(self, loc: Location, cache: Cache) -> None:
        self.uri = loc.uri
        self.location = loc
        self.cache = cache
        # each listed shard's cache path -> (bytes, mtime in ns) of its object on the store
        self._objects: dict[Path, tuple[int, int]] = {}
        super().__init__(cache.dir)

    def __repr__(self) -> str:
        return f"Run({self.address!r})"

    @property
    def address(self) -> str:
        """The run's URI, credentials hidden (``path`` is the local cache it is read through)."""
        return redact(self.uri)

    def _error(self, exc: BaseException) -> RunError:
        return RunError(f"{redact(self.uri)}: {error_line(exc)}")

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.path).as_posix()

    def _download(self, files: list[Path]) -> None:
        """Fetch these cache files from their objects (concurrently: the store's latency bounds one)."""
        jobs = [(self.location.path(self._rel(p)), p) for p in files]
        try:
            if len(jobs) > 1:
                with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
                    list(pool.map(lambda job: self.cache._download(*job), jobs))
            elif jobs:
                self.cache._download(*jobs[0])
        except OSError as exc:
            raise self._error(exc) from exc

    def _paths(self, filters: Any) -> Any:
        """(sealed shards, no live files) the filters may need, listed on the store; their index
        files are brought into the cache (the shards are not)."""
        return self._list(filters, index_files=True), []

    def _list(self, filters: Any, index_files: bool) -> list[Path]:
        """The sealed shards the filters may need, listed on the store (with ``index_files``,
        their index files missing from the cache are fetched, concurrently)."""
        steps = filters.step if isinstance(filters.step, (list, tuple, set, frozenset)) else None
        if steps is not None and all(type(s) is int for s in steps):
            prefixes = [f"{SPANS_DIR}/step={s}" for s in sorted(set(steps))]
        else:
            single = filters.single_step() if steps is None else None
            prefixes = [SPANS_DIR if single is None else f"{SPANS_DIR}/step={single}"]
        shards: dict[Path, tuple[int, int]] = {}
        sidecars: dict[str, int] = {}
        try:
            for prefix in prefixes:
                for info in list_objects(self.location, prefix):
                    rel = info.path[len(self.location.root) + 1 :]
                    parts = rel.split("/")
                    if len(parts) != 4 or parts[3].startswith(("_", ".")):
                        continue  # only spans/step=S/worker=W/NAME, no temp or private objects
                    if parts[3].endswith(SEALED_SUFFIX):
                        shards[self.path / rel] = (info.size, info.mtime_ns or 0)
                    elif parts[3].endswith(INDEX_SUFFIX):
                        sidecars[rel] = info.size
        except OSError as exc:
            raise self._error(exc) from exc
        self._objects.update(shards)
        missing = []
        for shard in shards if index_files else ():
            index = index_path(shard)
            size = sidecars.get(self._rel(index))
            if size is not None and not is_cached(index, size):
                missing.append(index)
        self._download(missing)
        return sorted(shards)

    def _names(self, filters: Any) -> tuple[list[str], list[str]]:
        return [str(p) for p in self._paths(filters)[0]], []

    def _stamp(self, path: Path | str) -> tuple[int, int]:
        found = self._objects.get(Path(path))
        return found if found is not None else super()._stamp(path)

    def _sealed_source(self, path: Path, whole: bool) -> Any:
        found = self._objects.get(path)
        if found is None or is_cached(path, found[0]):
            return path
        if not whole:  # some columns only (an index rebuilt): read in place, nothing cached
            try:
                return self.location.fs.open_input_file(self.location.path(self._rel(path)))
            except OSError as exc:
                raise self._error(exc) from exc
        self._download([path])
        return path

    def _holds(self, path: Path, filters: Any) -> bool:
        """Whether a shard may hold rows of the filters' trajectories (its index says)."""
        if filters.trajectory_id is None:
            return True
        index = self._index(path, True)
        if index is None:
            return True
        ids = dict(filters.items())["trajectory_id"]
        return bool(pc.any(pc.is_in(index["id"], value_set=pa.array(ids, pa.string()))).as_py())

    def _read_sealed(self, path: Path, filters: Any, columns: Any, row_groups: Any = None) -> Any:
        if row_groups is None and not self._holds(path, filters):
            return None
        return super()._read_sealed(path, filters, columns, row_groups)

    def _fetch_shards(self, filters: Any) -> list[Path]:
        """The shards the filters may need, those holding their rows brought into the cache."""
        sealed = self._list(filters, index_files=filters.trajectory_id is not None)
        self._download(
            [p for p in sealed if not is_cached(p, self._objects[p][0]) and self._holds(p, filters)]
        )
        return sealed

    def fetch(self, step: int | None = None) -> None:
        """Bring the shards of one step (or of every step) into the cache."""
        self._fetch_shards(Filters(step=step))

    def load(self, traj_ids: Any, filters: Any = None, kinds: Any = None, skip_kinds: Any = ()) -> Any:
        wanted = list(traj_ids)
        if wanted:  # the shards holding them (their index files say which), all at once
            self._fetch_shards(Filters(**{**(filters or Filters()).__dict__, "trajectory_id": wanted}))
        return super().load(wanted, filters, kinds, skip_kinds)

    def spans(self, filters: Any = None, columns: Any = None, **kw: Any) -> Any:
        """Span rows, as ``Run.spans``: the shards holding payload columns are fetched (all at
        once), metadata columns alone are read in place; shards are read concurrently."""
        filters = filters or Filters(**kw)
        cols = list(columns) if columns is not None else None
        if cols is None or any(c in PAYLOAD_COLUMNS for c in cols):
            sealed = self._fetch_shards(filters)
        else:
            sealed = self._list(filters, index_files=filters.trajectory_id is not None)
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(sealed)))) as pool:
            tables = list(pool.map(lambda path: self._read_sealed(path, filters, cols), sealed))
        return concat_spans([t for t in tables if t is not None], cols)

    def step_partitions(self) -> list[str]:
        """The step folders on the store (listed, nothing fetched)."""
        try:
            names = list_dirs(self.location, SPANS_DIR)
        except OSError as exc:
            raise self._error(exc) from exc
        return [n.removeprefix("step=") for n in names if n.startswith("step=")]

    def file_signature(self) -> tuple[Any, ...]:
        """(object, bytes, mtime in ns) of every span and counter object on the store: changes
        whenever something is published (listed, nothing fetched)."""
        try:
            infos = list_objects(self.location, SPANS_DIR) + list_objects(self.location, manifest.WORKERS_DIR)
        except OSError as exc:
            raise self._error(exc) from exc
        return tuple(sorted((i.path, i.size, i.mtime_ns or 0) for i in infos))

    def stored_bytes(self) -> int:
        """Bytes of the span files on the store (listed, nothing fetched)."""
        try:
            return sum(info.size for info in list_objects(self.location, SPANS_DIR))
        except OSError as exc:
            raise self._error(exc) from exc

    def counters(self) -> dict[str, int]:
        try:
            self.cache.fetch(manifest.WORKERS_DIR)
        except OSError as exc:
            raise self._error(exc) from exc
        totals = super().counters()
        for entry in manifest.read_worker_counters(self.path):
            for key in ("upload_errors", "pending_uploads"):
                totals[key] = totals.get(key, 0) + int(entry.get(key, 0) or 0)
        return totals
