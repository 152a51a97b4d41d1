"""A local mirror of a remote run that fetches only what a read needs."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlreplay import settings
from rlreplay.format import manifest
from rlreplay.remote.location import Location, list_objects, read_bytes

#: Copies from the store in flight at once.
MAX_DOWNLOADS = 16


# ---- reading ------------------------------------------------------------------------------------


def cache_root() -> Path:
    chosen = settings.CACHE.get()
    if chosen:
        return Path(chosen).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "rlreplay" / "remote"


class Cache:
    """A local mirror of a remote run that fetches only the prefixes asked for."""

    def __init__(self, loc: Location, directory: Path | None = None) -> None:
        self.loc = loc
        self.dir = directory or cache_root() / loc.key / loc.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self._synced: set[str] = set()

    def fetch(self, rel: str, *, skip_private: bool = True) -> int:
        """Mirror every object under ``rel`` that the cache lacks; returns how many were fetched."""
        infos = list_objects(self.loc, rel)
        todo = []
        for info in infos:
            name = info.path[len(self.loc.root) + 1 :]
            if skip_private and any(part.startswith(("_", ".")) for part in name.split("/")[-1:]):
                continue
            if not is_cached(self.dir / name, info.size):
                todo.append(name)
        self.download(todo)
        return len(todo)

    def download(self, names: Sequence[str]) -> None:
        """Copy these run files (paths relative to the run) from the store into the cache, whole,
        concurrently (the store's latency bounds one copy)."""
        if len(names) > 1:
            with ThreadPoolExecutor(max_workers=min(MAX_DOWNLOADS, len(names))) as pool:
                list(pool.map(self._copy, names))
        elif names:
            self._copy(names[0])

    def _copy(self, name: str) -> None:
        local = self.dir / name
        remote = self.loc.path(name)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with self.loc.fs.open_input_stream(remote) as src, open(tmp, "wb") as out:
            while chunk := src.read(8 << 20):
                out.write(chunk)
        os.replace(tmp, local)

    def fetch_manifest(self) -> bool:
        """Refresh ``run.json``; False when the run has none."""
        try:
            data = read_bytes(self.loc, manifest.MANIFEST)
        except FileNotFoundError:
            return False
        tmp = self.dir / f".{manifest.MANIFEST}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.dir / manifest.MANIFEST)
        return True


def is_cached(path: Path, size: int) -> bool:
    """Whether the cache holds this file as the store has it (objects are written once, whole)."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False
