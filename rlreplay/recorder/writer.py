"""The recorder's batching policy: the span queue, the writer thread, batches by age and size, flushes.

Split as OpenTelemetry's batch span processor and exporter: the calling threads only queue events
(``Recorder.submit``); the writer thread turns span events into rows (``rows.encode_row``), keeps
each step's rows until a batch is due, and hands batches to its sink (``shards.sink.ShardSink``:
live files, sealing), which answers what it did. Counters of what did not reach disk, flush
acknowledgements and warnings are kept here.
"""

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

import pyarrow as pa

from rlreplay.format import manifest
from rlreplay.format.keys import TrajectoryKey
from rlreplay.recorder.events import (
    CLOSE,
    FLUSH,
    OPEN,
    SPAN,
    Control,
    OpenTrajectory,
    OpMeta,
    SpanEvent,
)
from rlreplay.recorder.rows import PrefixCache, Problem, StepBuffer, encode_row, trajectory_id, trajectory_ids
from rlreplay.recorder.workers import resolve_worker_name
from rlreplay.remote import publish
from rlreplay.shards.layout import safe_name
from rlreplay.shards.lease import Lease
from rlreplay.shards.live import live_options
from rlreplay.shards.sink import GoneFile, ShardSink

log = logging.getLogger("rlreplay")

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
    #: a step's ended trajectories are written at most this often, each within this long of its end
    #: (one batch per trajectory costs the writer more than the trajectory's numbers do)
    min_write_interval_s: float = 0.05
    max_batch_bytes: int = 8 << 20
    fsync_interval_s: float = 1.0
    max_field_bytes: int | None = 4 << 20
    # A live file is closed and sealed (on the sealing thread) once it holds this many bytes of
    # Arrow data or is this old, so a step that never ends (step -1) never grows one file, and
    # sealing one needs at most ~3x this in memory. A finished step is sealed once idle this long.
    max_partial_bytes: int = 16 << 20
    max_partial_age_s: float = 600.0
    seal_idle_s: float = 30.0
    #: makes the sink batches go to (``ShardSink``'s arguments); None: ``ShardSink``, span files
    #: in ``run_dir`` (another: e.g. a disk that stalls, to test who waits for it)
    sink: Callable[..., ShardSink] | None = None


# The writer works in slices and lets the GIL go between them, so an event loop waiting for it
# waits a slice, not the interpreter's 5 ms switch interval.
_WORK_SLICE_S = 0.001
#: queued bytes that wake the writer before its next cycle (it encodes spans while their lists are
#: still in the CPU's caches, and the queue does not fill between cycles)
WAKE_BYTES = 512 << 10
_YIELD_S = 0.0001


class _Step:
    """A step as the policy sees it: its rows waiting for a batch, its open trajectories."""

    __slots__ = ("buffer", "last_write", "open", "root_ended", "spilled", "spilled_in_file")

    def __init__(self) -> None:
        self.buffer = StepBuffer()
        self.open = 0  # explicit trajectories begun and not ended
        self.root_ended = False  # a trajectory ended since the last batch: write it now
        self.spilled = 0  # rows in ``buffer`` a calling thread encoded (queue full, policy=spill)
        self.spilled_in_file = 0  # such rows in the step's live file
        self.last_write: float | None = None  # when a batch of it was last written (monotonic)


class Recorder:
    """One per process: owns the queue, the writer thread, the steps' rows and the sink."""

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
        # the steps, the prefix cache and the sink: the writer thread's, and a calling thread's while
        # it encodes a span itself (queue full, policy=spill)
        self._lock = threading.RLock()
        self._term_pending = False  # SIGTERM came while this thread held the lock (see defer_sigterm)
        self._steps: dict[int | None, _Step] = {}
        self._prefixes = PrefixCache()
        self._max_step: int | None = None
        make_sink = config.sink or ShardSink
        self._sink = make_sink(config.run_dir, config, self._worker, self._warn_once, self._on_sealed)
        self._last_fsync = time.monotonic()
        self._last_counters = 0.0
        self._counters_dirty = False
        self._warned: set[str] = set()
        self._closed = False
        self._urgent = False
        self._next_write: float | None = None  # when a step's ended trajectories are next due (monotonic)
        self.worker: str | None = safe_name(config.worker) if config.worker else None
        self._pid = os.getpid()
        try:
            self._lease: Lease | None = Lease(config.run_dir, on_close_request=self.close)
        except OSError:
            self._lease = None  # an unwritable run directory is reported when spans are written

    # ---- calling thread -------------------------------------------------------------------

    def on_end(self, span: SpanEvent) -> None:
        """A span ended: queue it. All that recording a span costs the calling thread, unless the
        queue is full and the policy is spill; never blocks on I/O otherwise, never raises."""
        try:
            if self._closed:
                self.count_loss("lost", 1, "closed", "a span ended after rlreplay.close(); not recorded")
                return
            queued = self._enqueued - self._written
            if queued > self.config.max_queue_bytes:
                self._overflow(span)
                return
            self._enqueued += span.nbytes
            self._queue.append(span)
            if queued + span.nbytes > WAKE_BYTES and not self._wake.is_set():
                self._wake.set()
        except Exception as exc:
            self.count_loss("lost", 1, "submit", f"could not queue a span ({type(exc).__name__}: {exc})")
            return
        if self._thread is None:
            self.start()

    def offer(self, event: SpanEvent | Control) -> bool:
        """Queue ``event`` when the queue has room for it and say True; False, with nothing done, when
        it is full (a thread that must never wait hands it to one that may: ``on_end`` there).
        Never blocks, never encodes, never raises."""
        try:
            full = self._enqueued - self._written > self.config.max_queue_bytes
            if event.kind == SPAN and full and not self._closed:
                return False
            self.submit(event)
            return True
        except Exception:
            return False

    def submit(self, event: SpanEvent | Control) -> None:
        """Queue an event (a span goes to ``on_end``)."""
        if event.kind == SPAN:
            self.on_end(event)
        elif not self._closed:
            self._enqueued += event.nbytes
            self._queue.append(event)
            if self._thread is None:
                self.start()

    def wake(self) -> None:
        """Have the writer take what is queued now, not at its next cycle."""
        self._wake.set()

    def _overflow(self, event: SpanEvent) -> None:
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
        if event.parent_id is None:  # keep the step's open count right; the writer forgets the trajectory
            self._queue.append(Control(CLOSE, event.traj))
            if self._thread is None:
                self.start()

    def _spill(self, event: SpanEvent) -> None:
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
                    self._enqueued += event.nbytes
                    queue.append(event)
                else:
                    self._ingest(event, spilled=True)
                if flushes:
                    self._end_cycle(flushes, force=True)
        finally:
            if self._term_pending:
                self.on_deferred_term()

    def defer_sigterm(self) -> bool:
        """True when this thread is encoding spans itself (it holds the writer's lock): the SIGTERM
        being handled is then acted on once it lets go (``on_deferred_term``), not here."""
        is_owned = getattr(self._lock, "_is_owned", None)
        if self._closed or not (is_owned and is_owned()):
            return False
        self._term_pending = True
        return True

    def start(self) -> None:
        """Start the writer thread (the first queued event does, too)."""
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

    def _run(self) -> None:
        warm_up()
        while True:
            wait = self.config.flush_interval_s
            if self._next_write is not None:
                wait = min(wait, max(self._next_write - time.monotonic(), 0.0))
            self._wake.wait(wait)
            self._wake.clear()
            try:
                self._cycle()
            except Exception as exc:  # keep the thread alive whatever happens
                self._warn_once("writer", f"writer error: {type(exc).__name__}: {exc}")
            if self._closed and not self._queue:
                return

    def _cycle(self, force: bool = False) -> None:
        flushes: list[threading.Event | None] = []
        sync = False  # a FLUSH came: fsync too
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
            sync = sync or kind == FLUSH
            if kind == SPAN and on_writer and clock() > slice_end:
                time.sleep(_YIELD_S)  # hand the GIL to the training threads (an event loop)
                slice_end = clock() + _WORK_SLICE_S
        self._end_cycle(flushes, force, sync)

    def _take(
        self, event: SpanEvent | Control, flushes: list[threading.Event | None], spilled: bool = False
    ) -> int:
        """Apply one queued event (the lock is held); its kind."""
        self._written += event.nbytes
        kind = event.kind
        if kind == SPAN:
            self._ingest(event, spilled)
        elif kind == OPEN:
            self._step(event.subject.step).open += 1
        elif kind == CLOSE:
            traj = event.subject
            step = self._step(traj.step)
            if traj.explicit:
                step.open -= 1
            step.root_ended = True
            self._prefixes.drop(trajectory_id(traj.id))
        else:
            flushes.append(event.subject)
            self._urgent = False
        return kind

    def _end_cycle(
        self, flushes: list[threading.Event | None], force: bool, sync: bool | None = None
    ) -> None:
        """Write the batches that are due (all with ``force`` or a flush), fsync (with ``sync``, by
        default ``force``, or when one is due), seal finished steps, then wake whoever waits on
        ``flushes``."""
        now = time.monotonic()
        sync = force if sync is None else sync or force
        force = force or bool(flushes)
        config = self.config
        next_write = None
        with self._lock:
            for step_key, step in list(self._steps.items()):
                buf = step.buffer
                if not buf.rows:
                    continue
                ended_due = step.root_ended and (
                    step.last_write is None or now - step.last_write >= config.min_write_interval_s
                )
                if (
                    force
                    or ended_due
                    or now - buf.first_at >= config.max_batch_age_s
                    or buf.nbytes >= config.max_batch_bytes
                ):
                    self._write(step_key, step)
                elif step.root_ended:  # due once the step's last batch is old enough
                    due = step.last_write + config.min_write_interval_s
                    next_write = due if next_write is None else min(next_write, due)
            self._next_write = next_write
            if sync or now - self._last_fsync >= config.fsync_interval_s:
                self._fsync()
            self._finish_steps()
        if (self._counters_dirty and now - self._last_counters >= 1.0) or now - self._last_counters > 10:
            self._save_counters()
        for done in flushes:
            if done is not None:
                done.set()

    def _step(self, step_key: int | None) -> _Step:
        step = self._steps.get(step_key)
        if step is None:
            step = self._steps[step_key] = _Step()
            if step_key is not None and (self._max_step is None or step_key > self._max_step):
                self._max_step = step_key
        return step

    def _ingest(self, event: SpanEvent, spilled: bool = False) -> None:
        """Encode a span into its step's rows (the lock is held: the prefix cache is shared by the
        threads that encode); ``spilled``: on a calling thread."""
        traj = event.traj
        step = self._step(traj.step)
        row, nbytes, problems = encode_row(event, self.config, self._worker(), self._prefixes)
        if problems:
            self._report(problems)
        if row is not None:
            step.buffer.append(row, nbytes)
            if spilled:
                step.spilled += 1
                self.counters["spilled"] += 1
                self._counters_dirty = True
        if event.parent_id is None:
            step.root_ended = True
            if traj.explicit:
                step.open -= 1
        elif step.buffer.nbytes >= self.config.max_batch_bytes:
            self._write(traj.step, step)

    def _report(self, problems: list[Problem]) -> None:
        """Count the values encoding changed (``encode_errors``) and warn once per kind."""
        for problem in problems:
            if problem.counted:
                self.count_loss("encode_errors", 1, problem.key, problem.message)
            else:
                self._warn_once(problem.key, problem.message)

    def _write(self, step_key: int | None, step: _Step) -> None:
        """Hand a step's rows to the sink as a batch (the lock is held): counted as spans (those a
        calling thread encoded were counted as spilled), or as lost."""
        spilled, step.spilled = step.spilled, 0
        step.root_ended = False
        buf = step.buffer
        rows, table = buf.rows, buf.table
        try:
            batch, problems = buf.take_batch()
        except Exception as exc:
            self._sink.abandon(step_key)
            self._lost_batch(step, rows, table, spilled, exc)
            return
        if problems:
            self._report(problems)
        result = self._sink.export(step_key, batch)
        if result.error is not None:
            self._lost_batch(step, rows, table, spilled, result.error)
            return
        self.counters["spans"] += rows - spilled
        step.spilled_in_file = 0 if result.rotated else step.spilled_in_file + spilled
        step.last_write = time.monotonic()

    def _lost_batch(
        self, step: _Step, rows: int, table: list[tuple], spilled: int, exc: BaseException
    ) -> None:
        self.counters["spilled"] -= spilled
        step.spilled_in_file = 0  # the sink gave up the step's file
        self.count_loss("lost", rows, "lost", f"could not write spans ({type(exc).__name__}: {exc})")
        for tid in trajectory_ids(table):  # later spans must not share values that are lost
            self._prefixes.drop(tid)

    def _fsync(self) -> None:
        self._last_fsync = time.monotonic()
        for gone in self._sink.fsync():
            self._file_gone(gone)

    def _file_gone(self, gone: GoneFile) -> None:
        """A step's live file was removed under us (run dir deleted): its rows are counted lost."""
        step = self._steps.get(gone.step)
        spilled = 0
        if step is not None:
            spilled, step.spilled_in_file = step.spilled_in_file, 0
        self.counters["spans"] -= gone.rows - spilled
        self.counters["spilled"] -= spilled
        self.count_loss(
            "lost", gone.rows, "gone", f"{gone.path} was removed while recording: its spans are lost"
        )
        self._prefixes.clear()  # which trajectories had spans in it is not known: share nothing older

    def _finish_steps(self, all_steps: bool = False) -> None:
        """Hand finished steps' files to the sink for sealing: a step is finished when none of its
        trajectories is open and nothing is waiting, and a newer step began or it was idle a while."""
        now = time.monotonic()
        for step_key, step in list(self._steps.items()):
            newer_exists = step_key is not None and self._max_step is not None and step_key < self._max_step
            idle = step.last_write is not None and now - step.last_write >= self.config.seal_idle_s
            if all_steps or ((newer_exists or idle) and step.open <= 0 and not step.buffer.rows):
                if step.buffer.rows:
                    self._write(step_key, step)
                gone = self._sink.finish(step_key)
                if gone is not None:
                    self._file_gone(gone)
                del self._steps[step_key]
        if all_steps:
            for gone in self._sink.finish_all():
                self._file_gone(gone)

    def _on_sealed(self) -> None:
        """A file was sealed (on the sealing thread): the counters on disk follow, and a URI run's
        publisher uploads it now."""
        self._save_counters()
        publish.shard_sealed(self.config.run_dir)

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
            done = self._sink.force_flush(deadline - time.monotonic())
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
        self._queue.append(Control(FLUSH, done))
        self._wake.set()
        return done.wait(timeout)

    def request_flush(self) -> None:
        """Have the writer write and fsync everything queued so far, at once, without waiting for it."""
        if self._thread is not None and not self._closed:
            self._urgent = True
            self._queue.append(Control(FLUSH, None))
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
                self._finish_steps(all_steps=True)
            self._sink.shutdown(timeout)
            self._save_counters()
            self._report_losses()
        except Exception as exc:
            log.warning("rlreplay: close failed: %s", exc)
        finally:
            with contextlib.suppress(Exception):
                publish.recorder_closed(self.config.run_dir)  # uploads a URI run's spool
            if self._lease is not None:
                with contextlib.suppress(OSError):
                    self._lease.release()

    def _report_losses(self) -> None:
        missing = {
            k: self.counters[k] for k in ("dropped", "spilled", "lost", "encode_errors") if self.counters[k]
        }
        if missing:
            detail = ", ".join(f"{k}={v}" for k, v in missing.items())
            print(f"rlreplay: worker {self._worker()}: {detail}", file=sys.stderr)


_warmed_up = False


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
        traj = OpenTrajectory(TrajectoryKey(0, 0, 0, experiment="x"), {"a": 1}, explicit=False)
        event = SpanEvent(traj, 1, None, meta, 0, 1, None, ([1, 2],), {"k": "v"}, {"token_ids": [3]}, 0)
        row, nbytes, _ = encode_row(event, RecorderConfig(run_dir=Path(".")), "w")
        buf = StepBuffer()
        buf.append(row, nbytes)
        batch, _ = buf.take_batch()
        with pa.ipc.new_stream(pa.BufferOutputStream(), batch.schema, options=live_options()) as writer:
            writer.write_batch(batch)
