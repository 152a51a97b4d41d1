"""Opening a run by path or URI: a local directory, the newest under ./rlreplay-runs/, or an object store."""

from __future__ import annotations

import os
from pathlib import Path

from rlreplay import settings
from rlreplay.errors import RunError
from rlreplay.format import manifest
from rlreplay.read.run import RUNS_DIR, Run
from rlreplay.shards.layout import SPANS_DIR


def default_run_path() -> Path:
    """``$RLREPLAY_DIR``, else the newest run under ``./rlreplay-runs/``."""
    env = settings.DIR.get()
    if env:
        return Path(env)
    base = Path(RUNS_DIR)
    runs = [p for p in base.iterdir() if p.is_dir()] if base.is_dir() else []
    if not runs:
        raise RunError(f"no run given and none found under ./{RUNS_DIR}/ (pass a run directory)")
    return max(runs, key=lambda p: p.stat().st_mtime)


def open_run(path: str | os.PathLike[str] | None = None) -> Run:
    """Open a recorded run directory (default: ``$RLREPLAY_DIR`` or the newest under ./rlreplay-runs/)."""
    from rlreplay.read import remote as remote_run
    from rlreplay.remote import location

    uri = location.as_uri(path if path is not None else settings.DIR.get())
    if uri is not None:  # a run on an object store, read through a local cache
        return remote_run.open_remote(uri)
    run_path = location.local_path(path) if path is not None else default_run_path()
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
