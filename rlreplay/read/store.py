"""Where a run's files are kept: the ``Store`` a ``Run`` reads through, and the local folder store.

A run reads its span files through a store, as pyarrow reads through a ``pyarrow.fs``
filesystem: the store lists the files with their size and mtime, opens them, and makes them
local (an object store brings them into its read cache; a folder already is local). Everything
else a run does (run index, trajectory index, filters, row groups) is the same for every store.
The object store is ``rlreplay.read.remote.ObjectStore``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlreplay.format import manifest
from rlreplay.format.index import INDEX_SUFFIX
from rlreplay.shards.layout import SEALED_SUFFIX, SPANS_DIR, list_names, step_dirs

#: A file's (bytes, mtime in ns): what tells an index or a run index that it is current.
Stamp = tuple[int, int]


@runtime_checkable
class Store(Protocol):
    """Where a run's files are kept. Files are named by their path under ``root`` (a ``str`` or a
    ``Path``); ``root`` is the local folder they are read from (the run itself, or the read cache
    that mirrors a run on an object store). An object store that cannot be reached, or that
    refuses a read, raises ``RunError``; a local file that cannot be read raises ``OSError``."""

    #: the local folder the run's files are read from
    root: Path
    #: where the run is, as shown to a user (credentials hidden)
    address: str
    #: the read cache the files come through (None: they are read where they are)
    cache_dir: Path | None
    #: the run's URI, credentials included, for processes that open it again (None: a folder)
    uri: str | None
    #: file reads worth having in flight at once (an object store's latency: many)
    concurrency: int

    def list_span_files(self, steps: Sequence[int] | None) -> tuple[list[str], list[str]]:
        """(sealed shards, live files) of ``steps`` (None: every step), as paths under ``root``."""
        ...

    def stamp(self, name: str | Path) -> Stamp:
        """(bytes, mtime in ns) of a span file as the store has it (as last listed)."""
        ...

    def is_local(self, name: str | Path) -> bool:
        """Whether reading the file costs no fetch."""
        ...

    def make_local(self, names: Sequence[str | Path]) -> None:
        """Bring these files (shards, their index files) into ``root`` where they are not yet, at
        once; names the store does not hold are passed over."""
        ...

    def open_input(self, name: str | Path) -> Any:
        """What a file is read from where it is (a local path, or a random-access file on the store)."""
        ...

    def step_partitions(self) -> list[str]:
        """The values of the run's ``spans/step=*`` folders, as written (unsorted)."""
        ...

    def signature(self) -> tuple[Any, ...]:
        """(name, bytes, mtime) of every span and counter file: changes whenever one is written."""
        ...

    def stored_bytes(self) -> int:
        """Bytes of the span files where the run is kept."""
        ...

    def counters(self, warnings: list[str]) -> dict[str, int]:
        """The recording processes' counters, summed (unreadable files named in ``warnings``)."""
        ...


class LocalStore:
    """A run in a local (or mounted, shared) folder: files are read where they are."""

    cache_dir: Path | None = None
    uri: str | None = None
    concurrency = 1

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.address = str(self.root)

    def __repr__(self) -> str:
        return f"LocalStore({self.address!r})"

    def list_span_files(self, steps: Sequence[int] | None) -> tuple[list[str], list[str]]:
        if steps is None or len(steps) == 1:
            return list_names(self.root, None if steps is None else steps[0])
        sealed: list[str] = []
        live: list[str] = []
        for step in steps:
            more = list_names(self.root, step)
            sealed += more[0]
            live += more[1]
        return sealed, live

    def stamp(self, name: str | Path) -> Stamp:
        stat = os.stat(name)
        return stat.st_size, stat.st_mtime_ns

    def is_local(self, name: str | Path) -> bool:
        return True

    def make_local(self, names: Sequence[str | Path]) -> None:
        return None

    def open_input(self, name: str | Path) -> Any:
        return name

    def step_partitions(self) -> list[str]:
        return [d.name.removeprefix("step=") for d in step_dirs(self.root)]

    def signature(self) -> tuple[Any, ...]:
        return folder_signature(self.root)

    def stored_bytes(self) -> int:
        return sum(p.stat().st_size for p in Path(self.root, SPANS_DIR).rglob("*") if p.is_file())

    def counters(self, warnings: list[str]) -> dict[str, int]:
        return manifest.total_counters(self.root, warnings)


# ---- the files of a folder, looked at cheaply again and again ---------------------------------------

#: Sealed and index files never change once they have their name: a folder whose mtime is as
#: last seen holds the same ones. Other files (live ones grow) are looked at every time.
FIXED_SUFFIXES = (SEALED_SUFFIX, INDEX_SUFFIX)
#: A folder's mtime is trusted once it is this much older than the look that saw it (two changes
#: within one tick of the file system's clock leave one mtime).
SETTLED_NS = 2_000_000_000
#: folder -> (its mtime, when it was scanned, its sub-folders, (path, size, mtime) of its files)
_scanned: dict[str, tuple[int, int, list[str], list[tuple[str, int, int]]]] = {}


def scan_folder(folder: str, mtime: int) -> tuple[int, int, list[str], list[tuple[str, int, int]]]:
    """One listing of ``folder`` (whose mtime is ``mtime``): (mtime, now, sub-folders, files)."""
    now = time.time_ns()
    folders: list[str] = []
    files: list[tuple[str, int, int]] = []
    for entry in os.scandir(folder):
        try:
            if entry.is_dir(follow_symlinks=False):
                folders.append(entry.path)
            elif entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                files.append((entry.path, st.st_size, st.st_mtime_ns))
        except OSError:
            continue
    folders.sort(reverse=True)  # popped in order
    files.sort()
    return mtime, now, folders, files


def folder_signature(run_dir: str | os.PathLike[str]) -> tuple[Any, ...]:
    """(name, size, mtime) of every span and counter file of a run folder, folder by folder in name
    order: changes whenever anything is written.

    A folder unchanged since a settled look is not listed again; only its files that can change
    under their name are looked at again."""
    out: list[tuple[str, int, int]] = []
    stack = [os.path.join(run_dir, SPANS_DIR), os.path.join(run_dir, manifest.WORKERS_DIR)]
    while stack:
        folder = stack.pop()
        try:
            mtime = os.stat(folder).st_mtime_ns
            kept = _scanned.get(folder)
            if kept is None or kept[0] != mtime or kept[1] - mtime < SETTLED_NS:
                kept = _scanned[folder] = scan_folder(folder, mtime)
        except OSError:
            _scanned.pop(folder, None)
            continue
        stack.extend(kept[2])
        for path, size, changed in kept[3]:
            if not path.endswith(FIXED_SUFFIXES):
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                size, changed = st.st_size, st.st_mtime_ns
            out.append((path, size, changed))
    return tuple(out)
