"""Where a recorder's batches go: a live file per step, rotated, then sealed on a sealing thread.

The recorder's write side is split as OpenTelemetry's is: the recorder (``rlreplay.recorder.writer``)
is the batch processor (queue, batching policy, flush acknowledgements, counters), and a
:class:`ShardSink` is its exporter: ``export`` appends a batch to its step's live Arrow IPC file
(every batch whose write returned is readable after a crash), ``fsync`` makes the live files
durable, ``finish`` hands a finished step's file to the sealing thread, ``force_flush`` waits for
the seals, ``shutdown`` seals what is left. What went wrong comes back as results (:class:`Export`,
:class:`GoneFile`); the sink never raises into the recorder.

The recorder calls the sink from one thread at a time (it holds its lock); the sink's own sealing
thread only takes closed files from its queue.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import pyarrow as pa

from rlreplay.format import manifest
from rlreplay.shards.layout import partition_dir
from rlreplay.shards.live import PartialWriter
from rlreplay.shards.seal import seal, sealing_pool

Warn = Callable[[str, str], None]  # (key, message): warn once per key
#: Memory a seal freed goes back to the system once no seal has come for this long: given back after
#: each seal, a run of them (a step's files rotating) would fault the same pages in again, zeroed,
#: at every seal (a third of sealing's CPU).
RELEASE_IDLE_S = 2.0


class FileLimits(Protocol):
    """When a live file is closed and sealed (read at each write: a recorder's config may change)."""

    max_partial_bytes: int  # of Arrow data written
    max_partial_age_s: float


class Export(NamedTuple):
    """What ``export`` did with a batch."""

    rows: int  # rows written (0 when the batch was lost)
    error: BaseException | None = None  # why the batch could not be written: it is lost
    rotated: bool = False  # the step's file was closed after this batch and queued for sealing


class GoneFile(NamedTuple):
    """A step's live file removed from under the recorder (the run directory deleted): its rows are lost."""

    step: int | None
    path: Path
    rows: int


class ShardSink:
    """One recording process's span files in ``run_dir``, under its worker's folder of each step."""

    def __init__(
        self,
        run_dir: Path,
        limits: FileLimits,
        worker: Callable[[], str],
        warn: Warn,
        on_sealed: Callable[[], None] = lambda: None,
        release_memory: Callable[[], None] | None = None,
        release_idle_s: float = RELEASE_IDLE_S,
    ) -> None:
        self.run_dir = run_dir
        self.limits = limits
        self.worker = worker  # the worker's name, resolved when the first file is opened
        self.warn = warn
        self.on_sealed = on_sealed  # after each seal, on the sealing thread
        self.release_memory = release_memory or _release_memory
        self.release_idle_s = release_idle_s
        self._files: dict[int | None, PartialWriter] = {}
        self._orphans: list[PartialWriter] = []  # files given up after an error; sealed at shutdown
        self._seal_queue: deque[PartialWriter] = deque()
        self._seal_wake = threading.Event()
        self._sealer: threading.Thread | None = None
        self._sealing = 0  # files queued for the sealer and not yet sealed
        self._sealed_cond = threading.Condition()
        self._closed = False

    # ---- the recorder's thread ------------------------------------------------------------------

    def export(self, step: int | None, batch: pa.RecordBatch) -> Export:
        """Append ``batch`` to the step's live file (opened on first use), rotating it when due.
        A batch that cannot be written is lost, and its file given up (its tail may be torn)."""
        writer = self._files.get(step)
        try:
            if writer is None:
                writer = self._files[step] = PartialWriter(self._partition(step))
            writer.write(batch)
        except Exception as exc:
            self.abandon(step)
            return Export(0, exc)
        if (
            writer.nbytes >= self.limits.max_partial_bytes
            or time.monotonic() - writer.opened_at >= self.limits.max_partial_age_s
        ):
            del self._files[step]
            self._to_sealer(writer)
            return Export(batch.num_rows, rotated=True)
        return Export(batch.num_rows)

    def abandon(self, step: int | None) -> None:
        """Stop appending to a step's file after an error: it is sealed at shutdown, or removed now
        when no batch of it was written."""
        writer = self._files.pop(step, None)
        if writer is None:
            return
        with contextlib.suppress(Exception):
            writer.close()
        if writer.rows:
            self._orphans.append(writer)
        else:
            with contextlib.suppress(OSError):
                writer.path.unlink()

    def fsync(self) -> list[GoneFile]:
        """Make every live file durable; the files removed meanwhile are returned (and let go)."""
        gone = []
        for step, writer in list(self._files.items()):
            lost = self._gone(step, writer)
            if lost is not None:
                gone.append(lost)
                continue
            try:
                writer.fsync()
            except OSError as exc:
                self.warn("fsync", f"fsync failed: {exc}")
        return gone

    def finish(self, step: int | None) -> GoneFile | None:
        """A step is done: close its live file and queue it for sealing (or report it removed)."""
        writer = self._files.get(step)
        if writer is None:
            return None
        lost = self._gone(step, writer)
        if lost is None:
            del self._files[step]
            self._to_sealer(writer)
        return lost

    def finish_all(self) -> list[GoneFile]:
        """Every step is done (the recorder closes): queue every file for sealing, given-up ones too."""
        gone = [lost for step in list(self._files) if (lost := self.finish(step)) is not None]
        orphans, self._orphans = self._orphans, []
        for writer in orphans:
            self._to_sealer(writer)
        return gone

    def _partition(self, step: int | None) -> Path:
        """This worker's folder for ``step``; refused if it resolves outside the run (a symlink)."""
        folder = partition_dir(self.run_dir, step, self.worker())
        return manifest.safe_run_path(self.run_dir, folder.relative_to(self.run_dir))

    def _gone(self, step: int | None, writer: PartialWriter) -> GoneFile | None:
        """The file, if it was removed under us (run directory deleted); it is then let go."""
        try:
            os.stat(writer.path)
            return None
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError:
            return None
        self._files.pop(step, None)
        with contextlib.suppress(Exception):
            writer.close()
        return GoneFile(step, writer.path, writer.rows)

    def _to_sealer(self, writer: PartialWriter) -> None:
        """Close a live file and queue it for the sealing thread (the recorder never waits for a seal)."""
        try:
            writer.close()
        except Exception as exc:
            self.warn("seal", f"could not close {writer.path.name} ({exc}); it stays recoverable")
            return
        with self._sealed_cond:
            self._sealing += 1
        self._seal_queue.append(writer)
        if self._sealer is None and not self._closed:
            thread = threading.Thread(target=self._seal_loop, name="rlreplay-sealer", daemon=True)
            try:
                thread.start()
                self._sealer = thread
            except RuntimeError:
                pass  # at interpreter shutdown: shutdown() seals what is queued
        self._seal_wake.set()

    # ---- any thread -------------------------------------------------------------------------------

    def force_flush(self, timeout: float) -> bool:
        """Wait until every file queued so far is sealed; True when done within ``timeout``."""
        with self._sealed_cond:
            return self._sealed_cond.wait_for(lambda: self._sealing <= 0, timeout)

    def shutdown(self, timeout: float) -> None:
        """No file comes any more: seal what is queued (on the sealing thread, within ``timeout``, or
        here when it is not running)."""
        self._closed = True
        sealer = self._sealer
        if sealer is not None and sealer.is_alive():
            self._seal_wake.set()
            sealer.join(timeout)
        if (sealer is None or not sealer.is_alive()) and self._seal_queued():
            self._release()

    # ---- the sealing thread -----------------------------------------------------------------------

    def _seal_loop(self) -> None:
        release_at: float | None = None  # when freed memory goes back, unless another seal comes first
        while True:
            wait = 1.0 if release_at is None else min(1.0, max(release_at - time.monotonic(), 0.0))
            self._seal_wake.wait(wait)
            self._seal_wake.clear()
            if self._seal_queued():
                release_at = time.monotonic() + self.release_idle_s
            elif release_at is not None and time.monotonic() >= release_at:
                release_at = None
                self._release()
            if self._closed:
                if self._seal_queued() or release_at is not None:
                    self._release()
                return

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            self.release_memory()

    def _seal_queued(self) -> bool:
        """Seal every queued file; whether there was one."""
        queue = self._seal_queue
        sealed = bool(queue)
        while queue:
            writer = queue.popleft()
            try:
                if writer.path.exists():
                    seal(writer.path)
            except Exception as exc:
                self.warn("seal", f"could not seal {writer.path.name} ({exc}); it stays recoverable")
            with self._sealed_cond:
                self._sealing -= 1
                self._sealed_cond.notify_all()
            with contextlib.suppress(Exception):
                self.on_sealed()
        return sealed


_malloc_trim: Any = None


def _release_memory() -> None:
    """Give freed memory back to the system: Arrow's pools (the default one, sealing's), and the C
    heap's free pages (numpy arrays of the threads that encoded spans live in glibc arenas, which
    keep what they once held)."""
    global _malloc_trim
    for pool in (pa.default_memory_pool(), sealing_pool()):
        with contextlib.suppress(Exception):
            pool.release_unused()
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _malloc_trim = False
    if _malloc_trim:
        with contextlib.suppress(Exception):
            _malloc_trim(0)
