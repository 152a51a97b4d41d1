"""The public recording API: init, trace_op, trajectory, flush, close; the calling thread only enqueues."""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from rlreplay import settings
from rlreplay.format import manifest, payload
from rlreplay.format.keys import TrajectoryKey
from rlreplay.format.schema import KIND_OP, KIND_TRAJECTORY
from rlreplay.recorder import events
from rlreplay.recorder.events import (
    OPEN,
    OPEN_BYTES,
    Control,
    F,
    OpenTrajectory,
    OpMeta,
    SpanEvent,
    format_span_id,
    format_trajectory_id,
    given_keys,
    payload_bytes,
)
from rlreplay.recorder.writer import (
    POLICY_DROP,
    POLICY_SPILL,
    Recorder,
    RecorderConfig,
    warm_up,
)
from rlreplay.remote import publish

log = logging.getLogger("rlreplay")
ENV_DIR = settings.DIR.name
ENV_EXPERIMENT = settings.EXPERIMENT.name
ENV_DISABLE = settings.DISABLE.name


_OFF = object()  # tracing disabled in this context
_replay: Any = None  # the Cassette served from (rlreplay.recorder.replay), when a replay is on
_CURRENT: ContextVar[Any] = ContextVar("rlreplay_current", default=None)


_mp_finalizer_pid: int | None = None


def _close_with_multiprocessing() -> None:
    """Forked multiprocessing children end with os._exit (no atexit): close from its exit hook too."""
    global _mp_finalizer_pid
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is None or _mp_finalizer_pid == os.getpid():
        return
    _mp_finalizer_pid = os.getpid()
    with contextlib.suppress(Exception):
        mp_util.Finalize(None, close, exitpriority=100)


# ---- process-wide state -------------------------------------------------------------------------

_recorder: Recorder | None = None
_env_checked = False
_init_lock = threading.Lock()
_forked_from: list[Recorder] = []  # the parent's recorder, kept (never used) in a forked child


def _new_recorder(config: RecorderConfig) -> Recorder:
    return Recorder(
        config,
        on_thread_start=_close_with_multiprocessing,
        on_deferred_term=lambda: _on_sigterm(signal.SIGTERM, None),
    )


def init(
    dir: str | os.PathLike[str] | None = None,
    experiment: str | None = None,
    worker: str | None = None,
    *,
    policy: str | None = None,
    max_queue_mb: float | None = None,
    max_field_bytes: int | None = 4 << 20,
) -> Recorder:
    """Start recording in this process into run directory ``dir`` (default: ``$RLREPLAY_DIR``)."""
    global _recorder, _env_checked
    run_dir = dir if dir is not None else settings.DIR.get()
    if not run_dir:
        raise ValueError(f"rlreplay.init needs dir= or ${ENV_DIR}")
    policy = policy or settings.POLICY.get_or_default()
    if policy not in (POLICY_SPILL, POLICY_DROP):
        raise ValueError(f"policy must be {POLICY_SPILL!r} or {POLICY_DROP!r}, not {policy!r}")
    queue_mb = max_queue_mb if max_queue_mb is not None else settings.MAX_QUEUE_MB.get_or_default()
    config = RecorderConfig(
        run_dir=publish.recording_dir(run_dir),  # a URI records into a local spool, published
        experiment=experiment or settings.EXPERIMENT.get(),
        worker=worker or settings.WORKER.get(),
        policy=policy,
        max_queue_bytes=int(queue_mb * (1 << 20)),
        max_field_bytes=max_field_bytes,
    )
    with _init_lock:
        if _recorder is not None:
            _recorder.close()
        try:
            manifest.ensure_manifest(config.run_dir, config.experiment)
        except Exception as exc:  # recording goes on; every span that cannot be written is counted
            log.warning("rlreplay: cannot write to %s (%s); spans will be counted as lost", run_dir, exc)
        _recorder = _new_recorder(config)
        _env_checked = True
    _install_exit_hooks()
    warm_up()
    _recorder.start()
    return _recorder


def _from_env() -> Recorder | None:
    global _env_checked
    with _init_lock:
        if _env_checked:
            return _recorder
        _env_checked = True
    if not settings.DIR.get() or settings.DISABLE.get_or_default():
        return None
    try:
        return init()
    except Exception as exc:
        log.warning("rlreplay: recording disabled: %s", exc)
        return None


def get_recorder() -> Recorder | None:
    return _recorder if _env_checked else _from_env()


def flush(timeout: float = 30.0) -> bool:
    """Write and fsync everything recorded so far in this process; False when that took longer than
    ``timeout`` or a span recorded since the last flush that returned True was lost (counted)."""
    rec = _recorder
    return rec.flush(timeout) if rec is not None else True


def close() -> None:
    """Seal this process's files; later spans are not recorded until ``init`` is called again."""
    global _recorder
    rec = _recorder
    _recorder = None
    if rec is not None:
        rec.close()


def stats() -> dict[str, int]:
    rec = _recorder
    return dict(rec.counters) if rec is not None else dict.fromkeys(manifest.COUNTERS, 0)


_hooks_installed = False


def _install_exit_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(close)
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    rec = _recorder
    if rec is not None and rec.defer_sigterm():  # mid-encode on this thread: closes once it lets go
        return
    close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _after_fork() -> None:
    """In a forked child: fresh ids, locks and recorder (same config); the parent's files stay its own."""
    global _recorder, _init_lock
    events.reset_ids()
    _init_lock = threading.Lock()
    if _recorder is not None:
        _forked_from.append(_recorder)
        _recorder = _new_recorder(_recorder.config)


# Registered at import, not in init: a child forked before init must not reuse the parent's ids.
os.register_at_fork(after_in_child=_after_fork)


def untraced_failure(rec: Recorder, exc: Exception) -> None:
    with contextlib.suppress(Exception):
        rec.count_loss("lost", 1, "hotpath", f"tracing failed ({type(exc).__name__}: {exc})")


def trace_op(
    fn: F | None = None,
    *,
    name: str | None = None,
    kind: str = KIND_OP,
    reduce_inputs: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    reduce_output: Callable[[Any], Any] | None = None,
    reward: Callable[[Any], float | None] | None = None,
) -> Any:
    """Record each call of a sync or async function as a span (``@trace_op`` or ``@trace_op(...)``)."""
    if fn is None:
        return functools.partial(
            trace_op,
            name=name,
            kind=kind,
            reduce_inputs=reduce_inputs,
            reduce_output=reduce_output,
            reward=reward,
        )
    meta = OpMeta(
        name=name or fn.__qualname__,
        kind=kind,
        fn=fn,
        reduce_inputs=reduce_inputs,
        reduce_output=reduce_output,
        reward=reward,
    )
    snapshot = payload.snapshot
    time_ns = time.time_ns
    current = _CURRENT

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = _recorder if _env_checked else _from_env()
            ctx = current.get()
            if rec is None or ctx is _OFF:
                return await fn(*args, **kwargs)
            try:
                if ctx is None:
                    traj, parent = OpenTrajectory(explicit=False), None
                else:
                    traj, parent = ctx
                span_id = next(events.span_ids)
                sargs = tuple(map(snapshot, args))
                skw = {k: snapshot(v) for k, v in kwargs.items()} if kwargs else kwargs
                token = current.set((traj, span_id))
            except Exception as exc:  # tracing must never break the call
                untraced_failure(rec, exc)
                return await fn(*args, **kwargs)
            start = time_ns()
            served, mark = False, meta  # its span is recorded with ``mark`` (a replay marks it)
            try:
                if _replay is not None and traj.replay is not None and meta.kind in _replay.kinds:
                    played, mark = _replay.serve(traj.replay, meta, sargs, skw)
                    if played.error is not None:
                        raise played.error
                    served, result = played.served, played.output
                    if not served:
                        result = await fn(*args, **kwargs)
                else:
                    result = await fn(*args, **kwargs)
            except BaseException as exc:
                end = time_ns()
                current.reset(token)
                rec.on_end(SpanEvent(traj, span_id, parent, mark, start, end, exc, sargs, skw, None, 256))
                raise
            end = time_ns()
            current.reset(token)
            if served:
                rec.on_end(SpanEvent(traj, span_id, parent, mark, start, end, None, sargs, skw, result, 256))
                return result
            try:
                out = snapshot(result)
            except Exception:  # a dict changed by another thread meanwhile
                out = result
            rec.on_end(
                SpanEvent(
                    traj,
                    span_id,
                    parent,
                    mark,
                    start,
                    end,
                    None,
                    sargs,
                    skw,
                    out,
                    payload_bytes(sargs, skw, out),
                )
            )
            return result

        async_wrapper.__rlreplay_meta__ = meta  # type: ignore[attr-defined]
        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = _recorder if _env_checked else _from_env()
        ctx = current.get()
        if rec is None or ctx is _OFF:
            return fn(*args, **kwargs)
        try:
            if ctx is None:
                traj, parent = OpenTrajectory(explicit=False), None
            else:
                traj, parent = ctx
            span_id = next(events.span_ids)
            sargs = tuple(map(snapshot, args))
            skw = {k: snapshot(v) for k, v in kwargs.items()} if kwargs else kwargs
            token = current.set((traj, span_id))
        except Exception as exc:  # tracing must never break the call
            untraced_failure(rec, exc)
            return fn(*args, **kwargs)
        start = time_ns()
        served, mark = False, meta  # its span is recorded with ``mark`` (a replay marks it)
        try:
            if _replay is not None and traj.replay is not None and meta.kind in _replay.kinds:
                played, mark = _replay.serve(traj.replay, meta, sargs, skw)
                if played.error is not None:
                    raise played.error
                served, result = played.served, played.output
                if not served:
                    result = fn(*args, **kwargs)
            else:
                result = fn(*args, **kwargs)
        except BaseException as exc:
            end = time_ns()
            current.reset(token)
            rec.on_end(SpanEvent(traj, span_id, parent, mark, start, end, exc, sargs, skw, None, 256))
            raise
        end = time_ns()
        current.reset(token)
        if served:
            rec.on_end(SpanEvent(traj, span_id, parent, mark, start, end, None, sargs, skw, result, 256))
            return result
        try:
            out = snapshot(result)
        except Exception:  # a dict changed by another thread meanwhile
            out = result
        rec.on_end(
            SpanEvent(
                traj, span_id, parent, mark, start, end, None, sargs, skw, out, payload_bytes(sargs, skw, out)
            )
        )
        return result

    wrapper.__rlreplay_meta__ = meta  # type: ignore[attr-defined]
    return wrapper


class trajectory:
    """Open a trajectory: its root span carries step, sample_index, rollout_n, validate, experiment.

    Usable as ``with`` or ``async with``; ``trace=False`` disables recording inside the block. A
    finished trajectory wakes the writer, which writes it with the step's others that end meanwhile
    (within ``min_write_interval_s``, 50 ms, of the step's last batch); with ``write_at_end=False``,
    at its next cycle (within ``flush_interval_s``), for callers that make a whole batch durable
    themselves (``Recorder.request_flush``, ``Recorder.wait_written``): each wake-up costs.
    """

    __slots__ = ("_meta", "_rec", "_span_id", "_start", "_token", "_trace", "_traj", "_write_at_end")

    def __init__(
        self,
        step: int | str | None = None,
        sample_index: int | str | None = None,
        rollout_n: int | str | None = None,
        validate: bool = False,
        experiment: str | None = None,
        name: str = "trajectory",
        trace: bool = True,
        write_at_end: bool = True,
        **attributes: Any,
    ) -> None:
        self._trace = trace
        self._write_at_end = write_at_end
        self._traj = OpenTrajectory(
            TrajectoryKey.of(step, sample_index, rollout_n, validate, experiment),
            attributes or None,
            given=given_keys(step, sample_index, rollout_n),
        )
        self._meta = _trajectory_meta(name)
        self._token: Any = None
        self._rec: Recorder | None = None
        self._span_id = 0
        self._start = 0

    def __enter__(self) -> trajectory:
        rec = _recorder if _env_checked else _from_env()
        if not self._trace or rec is None or _CURRENT.get() is _OFF:
            self._token = _CURRENT.set(_OFF)
            self._span_id = 0
            return self
        self._rec = rec
        if _replay is not None:
            self._traj.replay = _replay.open(self._traj.key)
        self._span_id = next(events.span_ids)
        rec.submit(Control(OPEN, self._traj, OPEN_BYTES))
        self._token = _CURRENT.set((self._traj, self._span_id))
        self._start = time.time_ns()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        end = time.time_ns()
        with contextlib.suppress(ValueError):
            _CURRENT.reset(self._token)
        rec = self._rec
        if self._span_id and rec is not None:
            self._rec = None
            if self._traj.replay is not None:
                self._traj.attributes = {**(self._traj.attributes or {}), **self._traj.replay.attributes()}
            rec.on_end(
                SpanEvent(
                    self._traj, self._span_id, None, self._meta, self._start, end, exc, (), {}, None, 256
                )
            )
            if self._write_at_end:
                rec.wake()  # write the finished trajectory soon: Ray kills actors without atexit

    async def __aenter__(self) -> trajectory:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    @property
    def id(self) -> str:
        return format_trajectory_id(self._traj.id)

    @property
    def root_span_id(self) -> str | None:
        """The id of the trajectory's root span, or None when it is not recorded."""
        return format_span_id(self._span_id) if self._span_id else None


@functools.lru_cache(maxsize=256)
def _trajectory_meta(name: str) -> OpMeta:
    return OpMeta(name=name, kind=KIND_TRAJECTORY)


def get_replay() -> Any:
    """The Cassette served from, or None when no replay is on."""
    return _replay


def set_replay(cassette: Any) -> Any:
    """Serve recorded ops from ``cassette`` (``rlreplay.recorder.replay.Cassette``; None: stop);
    returns the one it replaces."""
    global _replay
    previous, _replay = _replay, cassette
    return previous


@contextlib.contextmanager
def disabled() -> Any:
    """Record nothing inside this block (in this task or thread)."""
    token = _CURRENT.set(_OFF)
    try:
        yield
    finally:
        _CURRENT.reset(token)
