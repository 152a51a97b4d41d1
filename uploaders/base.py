"""The uploader protocol (prepare → send → result) and the ledger that makes uploads resumable.

A backend is one module with one class implementing :class:`Uploader`, registered under the
entry-point group ``rlreplay.uploaders`` (the built-in ones are registered the same way, in
rlreplay's ``pyproject.toml``). The shared machinery (selection, token2text, batching,
retries, deadlines, ledger, progress) lives in ``rlreplay.uploaders.pipeline`` and never knows
a backend's wire format.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from rlreplay.errors import RequestTimeout, RunError, UploadError  # noqa: F401 - backends import it from here
from rlreplay.format.redact import redact_value

LEDGER_DIR = "_uploads"


@dataclass
class Prepared:
    """One trajectory in a backend's wire form, ready to send."""

    trajectory_id: str
    backend_id: str
    body: Any
    nbytes: int
    text: bool = False  # decoded text included (recorded in the ledger)


@dataclass
class SendResult:
    """What happened to one prepared trajectory."""

    trajectory_id: str
    backend_id: str
    ok: bool
    nbytes: int = 0
    error: str | None = None
    retryable: bool = False


@dataclass(frozen=True)
class BackendOption:
    """A command-line option a backend declares (``rlreplay upload --backend NAME --help`` lists it)."""

    flag: str  # "--endpoint"
    help: str
    metavar: str = "VALUE"
    multiple: bool = False  # may be given several times (values come as a list)

    @property
    def key(self) -> str:
        """The name the value goes under in ``BackendOptions.values`` (``--my-opt`` → ``my_opt``)."""
        return self.flag.lstrip("-").replace("-", "_")


T = TypeVar("T")


def within(timeout: float | None, what: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, or :class:`RequestTimeout` if it has not returned after ``timeout`` s.

    One overall deadline per request, whatever the client library's own timeouts and retries:
    the call runs on a daemon thread that is left behind when the deadline passes.
    """
    if timeout is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=call, name="rlreplay-request", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RequestTimeout(f"no answer from {what} within {timeout:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def public_url(url: str) -> str:
    """``url`` without credentials (user:password@) or query string, for ledgers and output."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url.split("@")[-1]
    if not parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def secrets_of_url(url: str) -> list[str]:
    """The credentials a URL carries (userinfo, query values), to scrub from messages."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return []
    found = [v for v in (parts.password, parts.username) if v]
    found += [v for _, v in urllib.parse.parse_qsl(parts.query) if len(v) >= 6]
    return found


def scrub(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


@dataclass
class Ledger:
    """Append-only record, per run and target, of trajectories the backend already has."""

    path: Path
    _done: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the target named in a new ledger's first line
    target: str = ""

    @classmethod
    def open(cls, run_dir: Path, backend: str, target: str, create: bool = True) -> Ledger:
        """The ledger for ``target``. Its file (and the ledger folder) is created with the first
        success it records: an upload that sends nothing leaves nothing behind. With
        ``create=False`` (a dry run) nothing is written even to an existing one."""
        digest = hashlib.sha256(target.encode()).hexdigest()[:16]
        folder = Path(run_dir) / LEDGER_DIR
        if folder.exists() and not folder.is_dir():
            raise RunError(f"{folder} is not a directory (upload ledgers go there); move it away")
        ledger = cls(folder / f"{backend}-{digest}.jsonl", target=target)
        try:
            ledger._load(create)
        except OSError as exc:
            raise RunError(f"upload ledger {ledger.path}: {exc.strerror or exc}") from None
        return ledger

    def _load(self, create: bool = True) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            content = f.read()
        if create and content and not content.endswith(b"\n"):
            with open(self.path, "ab") as f:  # after a torn last line, new records start afresh
                f.write(b"\n")
        for number, line in enumerate(content.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a line torn by an interrupted upload
            if not isinstance(entry, dict) or not isinstance(entry.get("trajectory_id", ""), str):
                raise RunError(
                    f"upload ledger {self.path} line {number} is not an upload record; "
                    "fix or remove that line (or the file, to upload everything again)"
                )
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
        value = self._done.get(trajectory_id, {}).get("bytes")
        return value if isinstance(value, int) and value > 0 else 0

    def without_text(self) -> set[str]:
        """Trajectories sent without decoded text (entries that say so)."""
        return {tid for tid, entry in self._done.items() if entry.get("text") is False}

    def record(self, results: Iterable[SendResult], text: dict[str, bool] | None = None) -> None:
        """Durably note successful sends (fsynced before returning); a re-send adds a newer line.

        ``text`` says, per trajectory, whether decoded text went with it.
        """
        lines = []
        now = time.time()
        for r in results:
            if r.ok:
                entry = {
                    "trajectory_id": r.trajectory_id,
                    "backend_id": r.backend_id,
                    "bytes": r.nbytes,
                    "text": bool((text or {}).get(r.trajectory_id, False)),
                    "at": now,
                }
                self._done[r.trajectory_id] = entry
                lines.append(orjson.dumps(entry) + b"\n")
        if not lines:
            return
        if not self.path.exists():  # the first success: the ledger begins with its target
            self.path.parent.mkdir(parents=True, exist_ok=True)
            shown = redact_value(self.target)  # a server's address may hold a password
            lines.insert(0, orjson.dumps({"target": shown, "created_at": now}) + b"\n")
        with open(self.path, "ab") as f:
            f.write(b"".join(lines))
            f.flush()
            os.fsync(f.fileno())
