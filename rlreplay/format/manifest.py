"""The run manifest (``run.json``) and the per-process counters written beside it."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from rlreplay.errors import UnsafePathError
from rlreplay.format.redact import redact_argv, redact_mapping
from rlreplay.format.schema import FORMAT_VERSION

log = logging.getLogger("rlreplay")

MANIFEST = "run.json"
WORKERS_DIR = "_workers"
QUARANTINE_DIR = "_quarantine"
#: (``refused_calls``: calls a proxy replay answered 409, ``--on-diverge fail``)
COUNTERS = ("spans", "dropped", "spilled", "lost", "encode_errors", "refused_calls")

# Expected types of the manifest's known fields; a field of another type is ignored with a warning.
_NUMBER = (int, float)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "run_id": (str,),
    "format_version": (int,),
    "rlreplay_version": (str,),
    "experiment": (str,),
    "command": (list,),
    "host": (str,),
    "cwd": (str,),
    "status": (str,),
    "tokenizer": (str,),
    "tokenizer_files": (str,),
    "tokenizer_snapshot": (list,),
    "started_at": _NUMBER,
    "ended_at": _NUMBER,
    "exit_code": (int,),
    "recovered_shards": (int,),
    "recovered_spans": (int,),
    "discarded_bytes": (int,),
    "quarantined_files": (int,),
    **dict.fromkeys(("steps", "trajectories", "spans", "token_ids", "bytes_on_disk", *COUNTERS), (int,)),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("rlreplay")
    except PackageNotFoundError:
        return "0+unknown"


def safe_run_path(run_dir: str | os.PathLike[str], *parts: str | os.PathLike[str]) -> Path:
    """``run_dir/parts...``, refused (UnsafePathError) when it resolves outside the run directory."""
    root = Path(run_dir)
    path = root.joinpath(*parts)
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise UnsafePathError(f"{path} resolves to {real}, outside the run {real_root}; left alone")
    return path


def _json_text(data: Any, pad: int = 0) -> str:
    """``data`` as JSON text, padded with spaces to ``pad`` bytes when shorter."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str)
    return text.ljust(pad - 1) + "\n" if pad else text


def _write_tmp(path: Path, data: Any, pad: int = 0) -> Path:
    """``data`` as JSON in a fresh, fsynced temporary file beside ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    try:
        with open(tmp, "x") as f:
            f.write(_json_text(data, pad))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def write_json_atomic(path: Path, data: Any, pad: int = 0) -> None:
    """Replace ``path`` with ``data``: readers see the old or the new file, never a partial one."""
    tmp = _write_tmp(path, data, pad)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def create_json_atomic(path: Path, data: Any) -> bool:
    """Create ``path`` whole if it does not exist yet; False (nothing written) if another did first."""
    tmp = _write_tmp(path, data)
    try:
        os.link(tmp, path)  # atomic and exclusive: fails if the name exists
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        os.close(fd)
        os.replace(tmp, path)
        return True
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _warn(warnings: list[str] | None, message: str) -> None:
    if warnings is None:
        log.warning("rlreplay: %s", message)
    elif message not in warnings:
        warnings.append(message)


def _valid_field(key: str, value: Any) -> bool:
    types = _FIELD_TYPES.get(key)
    if types is None or (value is None and key != "format_version"):
        return True
    if isinstance(value, bool) or not isinstance(value, types):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if key == "command":
        return all(isinstance(arg, str) for arg in value)
    return True


def _load_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None), or (None, why it is unusable); ({}, None) when there is none."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    if not text.strip():
        return None, "empty"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return None, f"not valid JSON ({str(exc).splitlines()[0][:120]})"
    if not isinstance(data, dict):
        return None, f"a JSON {type(data).__name__}, not an object"
    return data, None


def read_manifest(run_dir: Path, warnings: list[str] | None = None) -> dict[str, Any]:
    """The run's manifest; a malformed file or field is ignored with a one-line warning naming it."""
    path = Path(run_dir) / MANIFEST
    data, problem = _load_manifest(path)
    if data is None:
        _warn(warnings, f"{path}: {problem}; ignored (the run is read without it)")
        return {}
    bad = [key for key, value in data.items() if not _valid_field(key, value)]
    for key in bad:
        shown = json.dumps(data.pop(key), default=str)[:40]
        _warn(warnings, f"{path}: ignored field {key!r} of unexpected type ({shown})")
    return data


def quarantine(run_dir: Path, path: Path) -> Path:
    """Move a file rlreplay cannot use to ``RUN/_quarantine/`` (same relative path), never deleting it."""
    run_dir = Path(run_dir)
    try:
        rel = path.relative_to(run_dir)
    except ValueError:
        rel = Path(path.name)
    target = safe_run_path(run_dir, QUARANTINE_DIR, rel)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        target = target.with_name(f"{target.name}.{time.time_ns():x}")
    os.rename(safe_run_path(run_dir, rel), target)
    return target


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


def _set_aside_unusable(run_dir: Path, problem: str) -> None:
    """An unusable ``run.json`` (empty after a full disk, garbage) is moved to the quarantine, not lost."""
    path = Path(run_dir) / MANIFEST
    try:
        if path.stat().st_size == 0:
            path.unlink()  # holds nothing
            log.warning("rlreplay: %s was empty (%s); writing a new one", path, problem)
        else:
            moved = quarantine(Path(run_dir), path)
            log.warning("rlreplay: %s was %s; moved to %s, writing a new one", path, problem, moved)
    except FileNotFoundError:
        pass


def ensure_manifest(run_dir: Path, experiment: str | None = None) -> dict[str, Any]:
    """Create ``run.json`` if no process has yet (first writer wins; readers never see it half written).

    An unusable one (empty after a full disk, not JSON) is set aside and replaced.
    """
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST
    for _ in range(3):
        data, problem = _load_manifest(path)
        if data:
            return read_manifest(run_dir)
        if problem is not None:
            _set_aside_unusable(run_dir, problem)
        fresh = new_manifest(experiment)
        if create_json_atomic(path, fresh):
            return fresh
    return read_manifest(run_dir)


def update_manifest(run_dir: Path, **fields: Any) -> dict[str, Any]:
    path = Path(run_dir) / MANIFEST
    data, problem = _load_manifest(path)
    if data is None:
        _set_aside_unusable(Path(run_dir), problem or "unusable")
    data = read_manifest(run_dir) or new_manifest()
    data.update(redact_mapping(fields))
    write_json_atomic(path, data)
    return data


#: A process's counters file is padded to this size, so that it can be rewritten in place on a full disk.
COUNTERS_FILE_BYTES = 1024


def write_worker_counters(run_dir: Path, key: str, counters: dict[str, Any]) -> None:
    """Replace a process's counters file; on a full disk, rewrite it in place (it keeps its size, so
    no new space is needed): the losses of a process whose disk is full are counted too."""
    path = Path(run_dir) / WORKERS_DIR / f"{key}.json"
    try:
        write_json_atomic(path, counters, pad=COUNTERS_FILE_BYTES)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        data = _json_text(counters, COUNTERS_FILE_BYTES).encode()
        try:
            f = open(path, "r+b")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise exc from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if len(data) > size:
                raise
            f.write(data.ljust(size))
            f.flush()
            os.fsync(f.fileno())


def read_worker_counters(run_dir: Path, warnings: list[str] | None = None) -> list[dict[str, Any]]:
    """Every process's counters; a malformed file is skipped with a one-line warning naming it."""
    folder = Path(run_dir) / WORKERS_DIR
    out = []
    if folder.is_dir():
        for path in sorted(folder.glob("*.json")):
            try:
                data = json.loads(path.read_bytes())
            except (OSError, ValueError, RecursionError) as exc:
                _warn(warnings, f"{path}: unreadable counters ({str(exc).splitlines()[0][:120]}); ignored")
                continue
            if not isinstance(data, dict):
                _warn(warnings, f"{path}: counters are a JSON {type(data).__name__}, not an object; ignored")
                continue
            for name in COUNTERS:
                value = data.get(name, 0)
                if value is None:
                    data[name] = 0
                elif isinstance(value, bool) or not isinstance(value, int):
                    shown = json.dumps(value, default=str)[:40]
                    _warn(warnings, f"{path}: ignored counter {name!r} of unexpected type ({shown})")
                    data[name] = 0
            out.append(data)
    return out


def total_counters(run_dir: Path, warnings: list[str] | None = None) -> dict[str, int]:
    totals = dict.fromkeys(COUNTERS, 0)
    for counters in read_worker_counters(run_dir, warnings):
        for name in COUNTERS:
            totals[name] += counters.get(name, 0)
    return totals
