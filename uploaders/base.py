"""The uploader protocol (prepare → send → result) and the ledger that makes uploads resumable.

A backend is one module with one class implementing :class:`Uploader`. The shared machinery
(selection, token2text, batching, retries, ledger, progress) lives in ``rlreplay.uploaders.pipeline`` and
never knows a backend's wire format.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import orjson

from rlreplay.store import Trajectory

LEDGER_DIR = "_uploads"


@dataclass
class Prepared:
    """One trajectory in a backend's wire form, ready to send."""

    trajectory_id: str
    backend_id: str
    body: Any
    nbytes: int


@dataclass
class SendResult:
    """What happened to one prepared trajectory."""

    trajectory_id: str
    backend_id: str
    ok: bool
    nbytes: int = 0
    error: str | None = None
    retryable: bool = False


class UploadError(Exception):
    """A failure that stops the whole upload (bad credentials, unknown project): one clear line."""


@runtime_checkable
class Uploader(Protocol):
    backend: str

    def target(self) -> str:
        """Where uploads go (e.g. ``mlflow:http://host:5000#experiment``); keys the ledger."""
        ...

    def prepare(self, trajectories: Sequence[Trajectory]) -> list[Prepared]:
        """Convert trajectories (text already decoded) into wire payloads; no network."""
        ...

    def send(self, batch: Sequence[Prepared]) -> list[SendResult]:
        """Send one batch; one result per prepared item. Raise UploadError only for fatal errors."""
        ...

    def close(self) -> None: ...


@dataclass
class Ledger:
    """Append-only record, per run and target, of trajectories the backend already has."""

    path: Path
    _done: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def open(cls, run_dir: Path, backend: str, target: str, create: bool = True) -> Ledger:
        """The ledger for ``target``; with ``create=False`` (a dry run) no file is written."""
        digest = hashlib.sha256(target.encode()).hexdigest()[:16]
        ledger = cls(Path(run_dir) / LEDGER_DIR / f"{backend}-{digest}.jsonl")
        ledger._load(target, create)
        return ledger

    def _load(self, target: str, create: bool = True) -> None:
        if not self.path.exists():
            if not create:
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as f:
                f.write(orjson.dumps({"target": target, "created_at": time.time()}) + b"\n")
            return
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    entry = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a torn last line from an interrupted upload
                if "trajectory_id" in entry:
                    self._done[entry["trajectory_id"]] = entry

    def __contains__(self, trajectory_id: object) -> bool:
        return trajectory_id in self._done

    def __len__(self) -> int:
        return len(self._done)

    def done(self) -> set[str]:
        return set(self._done)

    def nbytes(self, trajectory_id: str) -> int:
        """Bytes recorded for a trajectory already sent (0 if unknown)."""
        return int(self._done.get(trajectory_id, {}).get("bytes") or 0)

    def record(self, results: Iterable[SendResult]) -> None:
        """Durably note successful sends (fsynced before returning)."""
        lines = []
        now = time.time()
        for r in results:
            if r.ok and r.trajectory_id not in self._done:
                entry = {
                    "trajectory_id": r.trajectory_id,
                    "backend_id": r.backend_id,
                    "bytes": r.nbytes,
                    "at": now,
                }
                self._done[r.trajectory_id] = entry
                lines.append(orjson.dumps(entry) + b"\n")
        if not lines:
            return
        with open(self.path, "ab") as f:
            f.write(b"".join(lines))
            f.flush()
            os.fsync(f.fileno())
