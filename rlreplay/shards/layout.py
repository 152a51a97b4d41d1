"""Where span files live in a run directory: partition folders, file names, listing them."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

from rlreplay.format.schema import (
    NULL_PARTITION,
)

SPANS_DIR = "spans"
PARTIAL_SUFFIX = ".partial"
SEALED_SUFFIX = ".parquet"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(name: str) -> str:
    """A worker name usable as a folder name and equal to what is stored in the files."""
    return _UNSAFE.sub("_", name).strip("._") or "worker"


def partition_dir(run_dir: Path, step: int | None, worker: str) -> Path:
    """A step's folder; a step that is not an integer shares the null partition."""
    is_int = isinstance(step, int) and not isinstance(step, bool)
    step_part = str(step) if is_int else NULL_PARTITION
    return Path(run_dir) / SPANS_DIR / f"step={step_part}" / f"worker={worker}"


def new_uid() -> str:
    return f"{time.time_ns():x}-{os.getpid()}-{os.urandom(3).hex()}"


def sealed_path_for(partial: Path) -> Path:
    return Path(_sealed_name(str(partial)))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


LEASE_DIR = "_workers"


def step_dirs(run_dir: Path, step: int | None = None) -> Iterator[Path]:
    base = Path(run_dir) / SPANS_DIR
    if step is not None:
        candidate = base / f"step={step}"
        if candidate.is_dir():
            yield candidate
        return
    if not base.is_dir():
        return
    for entry in os.scandir(base):
        if entry.is_dir() and entry.name.startswith("step="):
            yield Path(entry.path)


def list_names(run_dir: Path, step: int | None = None) -> tuple[list[str], list[str]]:
    """``list_files`` as path strings (what listing a large run wants: no ``Path`` per file)."""
    sealed: list[str] = []
    partials: list[str] = []
    for sdir in step_dirs(run_dir, step):
        for worker in os.listdir(sdir):
            folder = f"{sdir}/{worker}"
            try:
                names = os.listdir(folder)
            except (NotADirectoryError, FileNotFoundError):
                continue
            for name in names:
                if name.endswith(SEALED_SUFFIX) and not name.startswith(("_", ".")):
                    sealed.append(f"{folder}/{name}")
                elif name.endswith(PARTIAL_SUFFIX) and name.startswith("_part-"):
                    partials.append(f"{folder}/{name}")
    by_parts = lambda name: name.replace("/", "\0")  # noqa: E731 - the order of sorted Paths
    sealed.sort(key=by_parts)
    partials.sort(key=by_parts)
    sealed_set = set(sealed)
    partials = [p for p in partials if _sealed_name(p) not in sealed_set]
    return sealed, partials


def _sealed_name(partial: str) -> str:
    folder, _, name = partial.rpartition("/")
    return f"{folder}/{name[1:].removesuffix(PARTIAL_SUFFIX)}{SEALED_SUFFIX}"


def list_files(run_dir: Path, step: int | None = None) -> tuple[list[Path], list[Path]]:
    """(sealed files, live partials) of a run, optionally of one step only."""
    sealed, partials = list_names(run_dir, step)
    return [Path(p) for p in sealed], [Path(p) for p in partials]
