"""The writer thread: queued span events become rows, live files, sealed shards."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from rlreplay.format import manifest
from rlreplay.recorder.events import (
    CLOSE,
    FLUSH,
    OPEN,
    SPAN,
    OpenTrajectory,
    OpMeta,
    format_span_id,
    format_trajectory_id,
    span_event,
)
from rlreplay.recorder.rows import PrefixCache, encode_row
from rlreplay.recorder.rows import StepBuffer as _StepBuffer
from rlreplay.recorder.workers import resolve_worker_name
from rlreplay.remote import publish
from rlreplay.shards.layout import partition_dir, safe_name
from rlreplay.shards.lease import Lease
from rlreplay.shards.live import PartialWriter, live_options
from rlreplay.shards.seal import seal

log = logging.getLogger("rlreplay")
ENV_POLICY = "RLREPLAY_POLICY"
ENV_MAX_QUEUE_MB = "RLREPLAY_MAX_QUEUE_MB"

LOSS_COUNTERS = ("dropped", "lost", "encode_errors")  # spans that did not reach disk as given
POLICY_SPILL = "spill"
POLICY_DROP = "drop"


@dataclass
class RecorderConfig:
    run_dir: Path
    experiment: str | None = None
    worker: str | None = None
    policy: str = POLICY_SPILL
    max_queue_bytes: int = 32 << 20  # what queued spans keep alive (see _nbytes), not list lengths
    flush_interval_s: float = 0.2
    max_batch_age_s: float = 1.0
    max_batch_bytes: int = 8 << 20
    fsync_interval_s: float = 1.0
    max_field_bytes: int | None = 4 << 20
    # A live file is closed and sealed (on the sealing thread) once it holds this many bytes of
    # Arrow data or is this old, so a step that never ends (step -1) never grows one file, and
    # sealing one needs at most ~3x this in memory. A finished step is sealed once idle this long.
    max_partial_bytes: int = 16 << 20
    max_partial_age_s: float = 600.0
    seal_idle_s: float = 30.0


# The writer works in slices and lets the GIL go between them, so an event loop waiting for it
# waits a slice, not the interpreter's 5 ms switch interval.
_WORK_SLICE_S = 0.001
_YIELD_S = 0.0001


class Recorder:
    """One per process: owns the queue, the writer thread and the open step files."""

    def __init__(
        self,
        config: RecorderConfig,
        on_thread_start: Callable[[], None] = lambda: None,
        on_deferred_term: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.on_thread_start = on_thread_start  # the writer thread started
        self.on_deferred_term = on_deferred_term  # SIGTERM arrived while this thread held the lock
        self.counters = dict.fromkeys(manifest.COUNTERS, 0)
        self._acknowledged_losses = 0  # spans lost up to the last flush that returned
        self._queue: deque = deque()
        self._enqueued = 0  # bytes put by callers
        self._written = 0  # bytes taken by the writer
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # the step buffers, their live files and the prefix cache: the writer thread's, and a calling
        # thread's while it encodes a span itself (queue full, policy=spill)
        self._lock = threading.RLock()
        self._term_pending = False  # SIGTERM came while this thread held the lock (see _on_sigterm)
        self._steps: dict[int | None, _StepBuffer] = {}
        self._last_write: dict[int | None, float] = {}
        self._seal_queue: deque[PartialWriter] = deque()
        self._seal_wake = threading.Event()
        self._sealer: threading.Thread | None = None
        self._sealing = 0  # files queued for the sealer and not yet sealed
        self._sealed_cond = threading.Condition()
        self._prefixes = PrefixCache()
        self._max_step: int | None = None
        self._orphans: list[PartialWriter] = []  # writers given up after an error; sealed at close
        self._last_fsync = time.monotonic()
        self._last_counters = 0.0
        self._counters_dirty = False
        self._warned: set[str] = set()
        self._closed = False
        self._urgent = False
        self.worker: str | None = safe_name(config.worker) if config.worker else None
        self._pid = os.getpid()
        try:
            self._lease: Lease | None = Lease(config.run_dir, on_close_request=self.close)
        except OSError:
            self._lease = None  # an unwritable run directory is reported when spans are written

    # ---- calling thread -------------------------------------------------------------------

    def submit(self, event: tuple) -> None:
        """Queue an event; never blocks on I/O unless the queue is full and the policy is spill."""
        try:
            if self._closed:
                if event[0] == SPAN:
                    self.count_loss("lost", 1, "closed", "a span ended after rlreplay.close(); not recorded")
                return
            if event[0] == SPAN and self._enqueued - self._written > self.config.max_queue_bytes:
                self._overflow(event)
                return
            self._enqueued += event[-1]
            self._queue.append(event)
        except Exception as exc:
            self.count_loss("lost", 1, "submit", f"could not queue a span ({type(exc).__name__}: {exc})")
            return
        if self._thread is None:
            self._start()

    def _overflow(self, event: tuple) -> None:
        traj = event[1]
        if self.config.policy == POLICY_DROP:
            self.count_loss("dropped", 1, "dropped", "queue full: dropping spans (policy=drop)")
        else:
            self._warn_once(
                "spilled", "queue full: the calling thread encodes queued spans itself (policy=spill)"
            )
            try:
                self._spill(event)
                return
            except Exception as exc:
                self.count_loss("lost", 1, "lost", f"could not write spans ({type(exc).__name__}: {exc})")
        if event[3] is None:  # keep the step's open count right; the writer forgets the trajectory
            self._queue.append((CLOSE, traj, 0))
            if self._thread is None:
                self._start()

    def _spill(self, event: tuple) -> None:
        """Queue full: take the writer's place for the oldest queued events until this span fits, then
        queue it (or, with nothing left queued, encode it here). Spans are encoded in the order they
        ended, whichever thread encodes them, so they share what the writer would have shared."""
        flushes: list[threading.Event | None] = []
        queue = self._queue
        try:
            with self._lock:
                while self._enqueued - self._written > self.config.max_queue_bytes:
                    try:
                        self._take(queue.popleft(), flushes, spilled=True)
                    except IndexError:
                        break
                if queue:
                    self._enqueued += event[-1]
                    queue.append(event)
                else:
                    self._ingest(event, spilled=True)
                if flushes:
                    self._end_cycle(flushes, force=True)
        finally:
            if self._term_pending:
                self.on_deferred_term()

    def _lock_held_here(self) -> bool:
        is_owned = getattr(self._lock, "_is_owned", None)
        return bool(is_owned and is_owned())

    def _write_rows(self, step: int | None, buf: _StepBuffer) -> int | None:
        """Append a buffer's rows to its live file: how many, or None (counted as lost) on failure."""
        rows, table = buf.rows, buf.table
        try:
            batch = buf.take_batch(self._encode_problem)
            if buf.writer is None:
                buf.writer = PartialWriter(self._partition(step))
            buf.writer.write(batch)
        except Exception as exc:
            self.count_loss("lost", rows, "lost", f"could not write spans ({type(exc).__name__}: {exc})")
            for tid in {row[0] for row in table}:  # later spans must not share values that are lost
                self._prefixes.drop(tid)
            return None
        return rows

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed:
                thread = threading.Thread(target=self._run, name="rlreplay-writer", daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # at interpreter shutdown: close() writes what is queued
                    self._warn_once("thread", f"no writer thread ({exc}); spans are written at close")
                    return
                self._thread = thread
                self.on_thread_start()

    def count_loss(self, counter: str, n: int, key: str, message: str) -> None:
        self.counters[counter] += n
        self._counters_dirty = True
        self._warn_once(key, message + "; counted in _workers/ (see `rlreplay info`)")

    # ---- writer thread --------------------------------------------------------------------

    def _worker(self) -> str:
        if self.worker is None:
            self.worker = safe_name(resolve_worker_name())
        return self.worker

    def _partition(self, step: int | None) -> Path:
        """This worker's folder for ``step``; refused if it resolves outside the run (a symlink)."""
        folder = partition_dir(self.config.run_dir, step, self._worker())
        return manifest.safe_run_path(self.config.run_dir, folder.relative_to(self.config.run_dir))

    def _run(self) -> None:
        warm_up()
        while True:
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()
            try:
                self._cycle()
            except Exception as exc:  # keep the thread alive whatever happens
                self._warn_once("writer", f"writer error: {type(exc).__name__}: {exc}")
            if self._closed and not self._queue:
                return

    def _cycle(self, force: bool = False) -> None:
        flushes: list[threading.Event | None] = []
        queue = self._queue
        # yield the GIL between slices, unless a batch ended and waits to be made durable
        on_writer = threading.current_thread() is self._thread and not self._urgent
        clock = time.perf_counter
        slice_end = clock() + _WORK_SLICE_S
        for _ in range(len(queue)):  # what is there now; later events wait for the next cycle
            with self._lock:  # a calling thread may take queued events too (queue full, policy=spill)
                try:
                    kind = self._take(queue.popleft(), flushes)
                except IndexError:
                    break
            if kind == SPAN and on_writer and clock() > slice_end:
                time.sleep(_YIELD_S)  # hand the GIL to the training threads (an event loop)
                slice_end = clock() + _WORK_SLICE_S
        self._end_cycle(flushes, force)

    def _take(self, event: tuple, flushes: list[threading.Event | None], spilled: bool = False) -> int:
        """Apply one queued event (the lock is held); its kind."""
        self._written += event[-1]
        kind = event[0]
        if kind == SPAN:
            self._ingest(event, spilled)
        elif kind == OPEN:
            self._buffer(event[1].step).open += 1
        elif kind == CLOSE:
            traj = event[1]
            buf = self._buffer(traj.step)
            if traj.explicit:
                buf.open -= 1
            buf.root_ended = True
            self._prefixes.drop(traj.id if type(traj.id) is str else format_trajectory_id(traj.id))
        else:
            flushes.append(event[1])
            self._urgent = False
        return kind

    def _end_cycle(self, flushes: list[threading.Event | None], force: bool) -> None:
        """Write the buffers that are due (all with ``force`` or a flush), fsync, seal finished steps,
        then wake whoever waits on ``flushes``."""
        now = time.monotonic()
        force = force or bool(flushes)
        with self._lock:
            for step, buf in list(self._steps.items()):
                if buf.rows and (
                    force
                    or buf.root_ended
                    or now - buf.first_at >= self.config.max_batch_age_s
                    or buf.nbytes >= self.config.max_batch_bytes
                ):
                    self._write(step, buf)
            if force or now - self._last_fsync >= self.config.fsync_interval_s:
                self._fsync_all()
            self._seal_finished_steps()
        if (self._counters_dirty and now - self._last_counters >= 1.0) or now - self._last_counters > 10:
            self._save_counters()
        for done in flushes:
            if done is not None:
                done.set()

    def _buffer(self, step: int | None) -> _StepBuffer:
        buf = self._steps.get(step)
        if buf is None:
            buf = self._steps[step] = _StepBuffer()
            if step is not None and (self._max_step is None or step > self._max_step):
                self._max_step = step
        return buf

    def _ingest(self, event: tuple, spilled: bool = False) -> None:
        """Encode a span into its step's buffer (the lock is held); ``spilled``: on a calling thread."""
        traj = event[1]
        buf = self._buffer(traj.step)
        try:
            row, nbytes = self._encode_row(event)
        except Exception as exc:
            self.count_loss(
                "encode_errors", 1, "encode", f"could not encode a span: {type(exc).__name__}: {exc}"
            )
            self._prefixes.drop(traj.id if type(traj.id) is str else format_trajectory_id(traj.id))
        else:
            buf.append(row, nbytes)
            if spilled:
                buf.spilled += 1
                self.counters["spilled"] += 1
                self._counters_dirty = True
        if event[3] is None:
            buf.root_ended = True
            if traj.explicit:
                buf.open -= 1
        elif buf.nbytes >= self.config.max_batch_bytes:
            self._write(traj.step, buf)

    def _encode_row(self, event: tuple) -> tuple[tuple, int]:
        """A span's row (the lock is held: the prefix cache is shared by the threads that encode)."""
        return encode_row(
            event,
            self.config,
            self._worker(),
            self._encode_problem,
            format_trajectory_id,
            format_span_id,
            self._prefixes,
            self._warn_once,
        )

    def _encode_problem(self, key: str, message: str) -> None:
        self.count_loss("encode_errors", 1, f"encode:{key}", message)

    def _write(self, step: int | None, buf: _StepBuffer) -> None:
        """Write a buffer's rows (the lock is held): counted as spans (those a calling thread encoded
        were counted as spilled), or as lost."""
        spilled, buf.spilled = buf.spilled, 0
        rows = self._write_rows(step, buf)
        if rows is None:
            self.counters["spilled"] -= spilled
            self._give_up(buf)
            return
        self.counters["spans"] += rows - spilled
        buf.spilled_in_file += spilled
        self._last_write[step] = time.monotonic()
        if self._rotate_due(buf.writer):
            self._to_sealer(buf.writer)
            buf.writer = None
            buf.spilled_in_file = 0

    def _rotate_due(self, writer: PartialWriter) -> bool:
        return (
            writer.nbytes >= self.config.max_partial_bytes
            or time.monotonic() - writer.opened_at >= self.config.max_partial_age_s
        )

    def _give_up(self, buf: _StepBuffer) -> None:
        """Stop appending to a file after an error (its tail may be torn); try to seal it at close,
        or remove it now when no batch of it was written."""
        if buf.writer is not None:
            with contextlib.suppress(Exception):
                buf.writer.close()
            if buf.writer.rows:
                self._orphans.append(buf.writer)
            else:
                with contextlib.suppress(OSError):
                    buf.writer.path.unlink()
            buf.writer = None
            buf.spilled_in_file = 0

    def _gone(self, buf: _StepBuffer) -> bool:
        """True, and its rows counted lost, if a buffer's live file was removed under us (run dir
        deleted)."""
        writer = buf.writer
        try:
            os.stat(writer.path)
            return False
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError:
            return False
        self.counters["spans"] -= writer.rows - buf.spilled_in_file
        self.counters["spilled"] -= buf.spilled_in_file
        buf.spilled_in_file = 0
        self.count_loss(
            "lost", writer.rows, "gone", f"{writer.path} was removed while recording: its spans are lost"
        )
        self._prefixes.clear()  # which trajectories had spans in it is not known: share nothing older
        with contextlib.suppress(Exception):
            writer.close()
        return True

    def _fsync_all(self) -> None:
        self._last_fsync = time.monotonic()
        for buf in self._steps.values():
            if buf.writer is not None:
                if self._gone(buf):
                    buf.writer = None
                    continue
                try:
                    buf.writer.fsync()
                except OSError as exc:
                    self._warn_once("fsync", f"fsync failed: {exc}")

    def _seal_finished_steps(self, all_steps: bool = False) -> None:
        """Hand finished steps' files to the sealing thread: a step is finished when none of its
        trajectories is open and nothing is waiting, and a newer step began or it was idle a while."""
        now = time.monotonic()
        for step, buf in list(self._steps.items()):
            newer_exists = step is not None and self._max_step is not None and step < self._max_step
            idle = now - self._last_write.get(step, now) >= self.config.seal_idle_s
            if all_steps or ((newer_exists or idle) and buf.open <= 0 and not buf.rows):
                if buf.rows:
                    self._write(step, buf)
                self._seal_buffer(buf)
                del self._steps[step]
                self._last_write.pop(step, None)
        if all_steps:
            orphans, self._orphans = self._orphans, []
            for writer in orphans:
                self._to_sealer(writer)

    def _seal_buffer(self, buf: _StepBuffer) -> None:
        if buf.writer is not None:
            if not self._gone(buf):
                self._to_sealer(buf.writer)
            buf.writer = None
            buf.spilled_in_file = 0

    def _to_sealer(self, writer: PartialWriter) -> None:
        """Close a live file and queue it for the sealing thread (the writer never waits for a seal)."""
        try:
            writer.close()
        except Exception as exc:
            self._warn_once("seal", f"could not close {writer.path.name} ({exc}); it stays recoverable")
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
                pass  # at interpreter shutdown: close() seals what is queued
        self._seal_wake.set()

    def _seal_loop(self) -> None:
        while True:
            self._seal_wake.wait(1.0)
            self._seal_wake.clear()
            self._seal_queued()
            if self._closed and self._thread_done():
                self._seal_queued()
                return

    def _thread_done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def _seal_queued(self) -> None:
        queue = self._seal_queue
        while queue:
            writer = queue.popleft()
            try:
                if writer.path.exists():
                    seal(writer.path)
            except Exception as exc:
                self._warn_once("seal", f"could not seal {writer.path.name} ({exc}); it stays recoverable")
            _release_memory()
            with self._sealed_cond:
                self._sealing -= 1
                self._sealed_cond.notify_all()
            self._save_counters()
            publish.shard_sealed(self.config.run_dir)  # a URI run's publisher uploads it now

    def _save_counters(self) -> None:
        self._last_counters = time.monotonic()
        self._counters_dirty = False
        data = {**self.counters, "worker": self._worker(), "pid": os.getpid(), "updated_at": time.time()}
        with contextlib.suppress(Exception):
            manifest.write_worker_counters(self.config.run_dir, f"{self._worker()}-{os.getpid()}", data)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("rlreplay: %s", message)

    # ---- control ----------------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Write and fsync everything recorded so far, and finish sealing the files of finished
        steps; True when done within ``timeout`` and no span since the last acknowledged flush was
        lost (a batch with a lost span is not acknowledged)."""
        deadline = time.monotonic() + timeout
        done = self.wait_written(timeout)
        if done and self._thread is not None and self._thread.is_alive():
            with self._sealed_cond:
                done = self._sealed_cond.wait_for(lambda: self._sealing <= 0, deadline - time.monotonic())
        losses = self._losses()
        whole = losses == self._acknowledged_losses
        if done:
            self._acknowledged_losses = losses
        return done and whole

    def _losses(self) -> int:
        return sum(self.counters[k] for k in LOSS_COUNTERS)

    def wait_written(self, timeout: float = 30.0) -> bool:
        """Block until everything recorded so far is written to its live file (which a killed
        process keeps) and fsynced; True when done within ``timeout``."""
        if self._thread is None or not self._thread.is_alive():
            return True
        done = threading.Event()
        self._urgent = True
        self._queue.append((FLUSH, done, 0))
        self._wake.set()
        return done.wait(timeout)

    def request_flush(self) -> None:
        """Have the writer write and fsync everything queued so far, at once, without waiting for it."""
        if self._thread is not None and not self._closed:
            self._urgent = True
            self._queue.append((FLUSH, None, 0))
            self._wake.set()

    def close(self, timeout: float = 60.0) -> None:
        """Drain the queue and seal every open step; idempotent, never raises."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        try:
            thread = self._thread
            if thread is not None and thread.is_alive():
                self._wake.set()
                thread.join(timeout)
            if thread is None or not thread.is_alive():
                self._cycle(force=True)
                self._seal_finished_steps(all_steps=True)
            sealer = self._sealer
            if sealer is not None and sealer.is_alive():
                self._seal_wake.set()
                sealer.join(timeout)
            if sealer is None or not sealer.is_alive():
                self._seal_queued()
            self._save_counters()
            self._report()
        except Exception as exc:
            log.warning("rlreplay: close failed: %s", exc)
        finally:
            with contextlib.suppress(Exception):
                publish.recorder_closed(self.config.run_dir)  # uploads a URI run's spool
            if self._lease is not None:
                with contextlib.suppress(OSError):
                    self._lease.release()

    def _report(self) -> None:
        missing = {
            k: self.counters[k] for k in ("dropped", "spilled", "lost", "encode_errors") if self.counters[k]
        }
        if missing:
            detail = ", ".join(f"{k}={v}" for k, v in missing.items())
            print(f"rlreplay: worker {self._worker()}: {detail}", file=sys.stderr)


_warmed_up = False
_malloc_trim: Any = None


def _release_memory() -> None:
    """Give freed memory back to the system: Arrow's pool, and the C heap's free pages (numpy arrays
    of the threads that encoded spans live in glibc arenas, which keep what they once held)."""
    global _malloc_trim
    with contextlib.suppress(Exception):
        pa.default_memory_pool().release_unused()
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _malloc_trim = False
    if _malloc_trim:
        with contextlib.suppress(Exception):
            _malloc_trim(0)


def warm_up() -> None:
    """Pay every one-time cost of a first write here: pyarrow's lazy imports (it imports pandas on its
    first conversion, 0.3-2 s), the row encoder, the live files' codec and the stream writer. Done at
    ``init``, before any trajectory can end, so the first batch is as quick to reach disk as later
    ones (a worker killed right after its first trajectories keeps them), and never at exit."""
    global _warmed_up
    if _warmed_up:
        return
    _warmed_up = True
    with contextlib.suppress(Exception):
        meta = OpMeta(name="warm-up")
        traj = OpenTrajectory.__new__(OpenTrajectory)
        traj.id, traj.step, traj.sample_index, traj.rollout_n = 0, 0, 0, 0
        traj.validate, traj.experiment, traj.attributes, traj.explicit = False, "x", {"a": 1}, False
        event = span_event(traj, 1, None, meta, 0, 1, None, ([1, 2],), {"k": "v"}, {"token_ids": [3]}, 0)
        config = RecorderConfig(run_dir=Path("."))
        row, nbytes = encode_row(event, config, "w", lambda *_: None, format_trajectory_id, format_span_id)
        buf = _StepBuffer()
        buf.append(row, nbytes)
        batch = buf.take_batch()
        with pa.ipc.new_stream(pa.BufferOutputStream(), batch.schema, options=live_options()) as writer:
            writer.write_batch(batch)
