"""The run manifest (``run.json``) and the per-process counters written beside it."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from rlreplay.redact import (  # noqa: F401 - redaction lives in rlreplay.redact; re-exported here
    REDACTED,
    redact_argv,
    redact_mapping,
    redact_url,
    redact_value,
)
from rlreplay.schema import FORMAT_VERSION

MANIFEST = "run.json"
WORKERS_DIR = "_workers"
COUNTERS = ("spans", "dropped", "spilled", "lost", "encode_errors")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("rlreplay")
    except PackageNotFoundError:
        return "0+unknown"


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / MANIFEST
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)


def new_manifest(
    experiment: str | None = None, command: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "run_id": uuid.uuid4().hex[:16],
        "format_version": FORMAT_VERSION,
        "rlreplay_version": version(),
        "experiment": experiment,
        "command": redact_argv(command or []),
        "host": socket.gethostname(),
        "started_at": time.time(),
        "ended_at": None,
        **redact_mapping(extra),
    }


def ensure_manifest(run_dir: Path, experiment: str | None = None) -> dict[str, Any]:
    """Create ``run.json`` if no process has yet (first writer wins)."""
    path = Path(run_dir) / MANIFEST
    if path.exists():
        return read_manifest(run_dir)
    data = new_manifest(experiment)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return read_manifest(run_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    return data


def update_manifest(run_dir: Path, **fields: Any) -> dict[str, Any]:
    data = read_manifest(run_dir) or new_manifest()
    data.update(redact_mapping(fields))
    write_json_atomic(Path(run_dir) / MANIFEST, data)
    return data


def write_worker_counters(run_dir: Path, key: str, counters: dict[str, Any]) -> None:
    write_json_atomic(Path(run_dir) / WORKERS_DIR / f"{key}.json", counters)


def read_worker_counters(run_dir: Path) -> list[dict[str, Any]]:
    folder = Path(run_dir) / WORKERS_DIR
    out = []
    if folder.is_dir():
        for path in sorted(folder.glob("*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
    return out


def total_counters(run_dir: Path) -> dict[str, int]:
    totals = dict.fromkeys(COUNTERS, 0)
    for counters in read_worker_counters(run_dir):
        for name in COUNTERS:
            totals[name] += int(counters.get(name, 0) or 0)
    return totals
