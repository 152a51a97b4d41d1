"""A run on an object store, read through the local read cache: the store a ``Run`` reads such a run with.

Listings fetch index files only; span reads fetch the shards they read, or read some columns of a
shard in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlreplay.errors import RunError, StorageError
from rlreplay.format import manifest
from rlreplay.format.index import INDEX_SUFFIX
from rlreplay.read.run import Run
from rlreplay.read.store import Stamp
from rlreplay.remote.cache import MAX_DOWNLOADS, Cache, is_cached
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

#: Counters only a run published to an object store has.
UPLOAD_COUNTERS = ("upload_errors", "pending_uploads")


def open_remote(uri: str) -> Run:
    """A :class:`rlreplay.read.run.Run` over a run URI, reading through a local cache."""
    try:
        store = ObjectStore(location(uri))
        if not store.cache.fetch_manifest() and not list_objects(store.location, SPANS_DIR):
            loc = store.location
            bucket = loc.root.split("/", 1)[0]
            if is_object_store(loc.fs) and not exists(loc, "") and not bucket_exists(loc, bucket):
                raise RunError(f"no bucket {bucket!r} at {redact(uri)} (or no access to it)")
            raise RunError(f"no run at {redact(uri)} (no {manifest.MANIFEST} and no {SPANS_DIR}/)")
        run = Run(store)
        store.keep_tokenizer(run.manifest)
        return run
    except StorageError as exc:
        raise RunError(str(exc)) from exc
    except OSError as exc:
        raise RunError(f"{redact(uri)}: {error_line(exc)}") from exc


class ObjectStore:
    """A run on a filesystem reached through pyarrow.fs (an object store, or any fsspec filesystem),
    read through a local cache that mirrors the files a read needs (``root``). Sealed shards and
    their index files only: live files stay with the processes that write them."""

    concurrency = MAX_DOWNLOADS

    def __init__(self, loc: Location, cache: Cache | None = None) -> None:
        self.location = loc
        self.uri = loc.uri
        self.cache = cache or Cache(loc)
        self.root = self.cache_dir = self.cache.dir
        self.address = redact(loc.uri)
        self._prefix = f"{self.root}/"
        # each listed file's cache path -> (bytes, mtime in ns) of its object on the store
        self._listed: dict[str, Stamp] = {}

    def __repr__(self) -> str:
        return f"ObjectStore({self.address!r})"

    def _error(self, exc: BaseException) -> RunError:
        return RunError(f"{self.address}: {error_line(exc)}")

    def _rel(self, name: str) -> str:
        """A cache path's path relative to the run (its object's name under the run's root)."""
        return (
            name[len(self._prefix) :]
            if name.startswith(self._prefix)
            else Path(name).relative_to(self.root).as_posix()
        )

    def list_span_files(self, steps: Sequence[int] | None) -> tuple[list[str], list[str]]:
        prefixes = [SPANS_DIR] if steps is None else [f"{SPANS_DIR}/step={s}" for s in steps]
        shards: list[str] = []
        root = len(self.location.root) + 1
        try:
            for prefix in prefixes:
                for info in list_objects(self.location, prefix):
                    rel = info.path[root:]
                    parts = rel.split("/")
                    if len(parts) != 4 or parts[3].startswith(("_", ".")):
                        continue  # only spans/step=S/worker=W/NAME, no temp or private objects
                    if parts[3].endswith((SEALED_SUFFIX, INDEX_SUFFIX)):
                        name = self._prefix + rel
                        self._listed[name] = (info.size, info.mtime_ns or 0)
                        if parts[3].endswith(SEALED_SUFFIX):
                            shards.append(name)
        except OSError as exc:
            raise self._error(exc) from exc
        return sorted(shards, key=lambda name: name.replace("/", "\0")), []

    def keep_tokenizer(self, kept: dict[str, Any]) -> None:
        """Bring the tokenizer files the run keeps (its manifest's ``tokenizer_snapshot``) into the
        cache once, like its other files: decoding a run on the store needs no other copy. A file
        the store lacks is left out (the manifest's tokenizer name is then used)."""
        from rlreplay.text.token2text import SNAPSHOT_FALLBACK, SNAPSHOT_FILES, SNAPSHOT_KEY

        names = kept.get(SNAPSHOT_KEY)
        if not isinstance(names, list):
            return
        known = (*SNAPSHOT_FILES, *SNAPSHOT_FALLBACK)
        for name in (n for n in names if n in known and not (self.root / n).is_file()):
            try:
                self.cache.download([name])
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise self._error(exc) from exc

    def stamp(self, name: str | Path) -> Stamp:
        found = self._listed.get(str(name))
        if found is not None:
            return found
        stat = Path(name).stat()
        return stat.st_size, stat.st_mtime_ns

    def is_local(self, name: str | Path) -> bool:
        found = self._listed.get(str(name))
        return found is None or is_cached(Path(name), found[0])

    def make_local(self, names: Sequence[str | Path]) -> None:
        todo = [self._rel(str(n)) for n in names if not self.is_local(n)]
        try:
            self.cache.download(todo)
        except OSError as exc:
            raise self._error(exc) from exc

    def open_input(self, name: str | Path) -> Any:
        if self.is_local(name):
            return name
        try:
            return self.location.fs.open_input_file(self.location.path(self._rel(str(name))))
        except OSError as exc:
            raise self._error(exc) from exc

    def step_partitions(self) -> list[str]:
        """The step folders on the store (listed, nothing fetched)."""
        try:
            names = list_dirs(self.location, SPANS_DIR)
        except OSError as exc:
            raise self._error(exc) from exc
        return [n.removeprefix("step=") for n in names if n.startswith("step=")]

    def signature(self) -> tuple[Any, ...]:
        """(object, bytes, mtime in ns) of every span and counter object on the store: changes
        whenever something is published (listed, nothing fetched)."""
        try:
            infos = list_objects(self.location, SPANS_DIR) + list_objects(self.location, manifest.WORKERS_DIR)
        except OSError as exc:
            raise self._error(exc) from exc
        return tuple(sorted((i.path, i.size, i.mtime_ns or 0) for i in infos))

    def stored_bytes(self) -> int:
        """Bytes of the span objects on the store (listed, nothing fetched)."""
        try:
            return sum(info.size for info in list_objects(self.location, SPANS_DIR))
        except OSError as exc:
            raise self._error(exc) from exc

    def counters(self, warnings: list[str]) -> dict[str, int]:
        """The counters the recording processes published (brought into the cache), with their
        uploads' errors and what they had left to upload."""
        try:
            self.cache.fetch(manifest.WORKERS_DIR)
        except OSError as exc:
            raise self._error(exc) from exc
        totals = manifest.total_counters(self.root, warnings)
        for entry in manifest.read_worker_counters(self.root):
            for key in UPLOAD_COUNTERS:
                totals[key] = totals.get(key, 0) + int(entry.get(key, 0) or 0)
        return totals
