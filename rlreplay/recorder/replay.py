"""Serving recorded ops: a cassette of recorded trajectories answers calls from them, by matchers.

Inside a trajectory whose key matches a recorded one, a call of a served kind is served the
recorded output of the op that every matcher of ``match_on`` accepts (default: the same position
among the calls of its kind, the same name, the same inputs without the adapter's volatile keys;
``rlreplay.recorder.matchers``). When none does, the trajectory has *diverged*, for the reason a
matcher gave: with ``on_diverge="live"`` that call and every later one run live, with ``"fail"``
the call raises :class:`ReplayDivergence`. The reason is kept on the trajectory (``reason``) and
on the cassette (``divergences``).

A :class:`Cassette` takes plain calls (kind, name, inputs as JSON values: :meth:`Cassette.play`), so
that anything answering calls from a recording uses it; the recorder's wrapper binds a call's
arguments first (:meth:`Cassette.serve`). The recorder's hot path pays one check of a module
global when no replay is on.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from rlreplay.errors import ReplayDivergence
from rlreplay.format import payload
from rlreplay.format.keys import TrajectoryKey
from rlreplay.recorder.matchers import (
    DEFAULT_MATCH_ON,
    JSON_SCALARS,
    Call,
    Matcher,
    RecordedOp,
    comparable,
    matchers,
    mismatch,
    position,
)

log = logging.getLogger("rlreplay")
ON_DIVERGE = ("live", "fail")

SERVED = "served"
DIVERGED = "diverged"
LIVE = "live"
#: Attributes a replay writes: on a trajectory's root (all three) and on a served or diverged span.
STATUS_KEY, SOURCE_KEY, REASON_KEY = "replay", "replay_of", "replay_reason"


def fresh_copy(value: Any) -> Any:
    """A copy of a recorded (JSON) value that the caller may change; scalars as they are."""
    if isinstance(value, dict):
        return {k: fresh_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        if JSON_SCALARS.issuperset(map(type, value)):
            return list(value)
        return [fresh_copy(v) for v in value]
    return copy.copy(value) if type(value) not in JSON_SCALARS else value


@dataclass
class RecordedTrajectory:
    id: str
    ops: dict[str, list[RecordedOp]]  # by kind, in call order (``position`` = index)
    prepared: bool = False  # inputs without the volatile keys


@dataclass
class Recording:
    """What a cassette serves from: recorded trajectories by key (experiment aside), and what the
    framework adapter of the recording says: its volatile keys and how to rebuild an output."""

    trajectories: dict[TrajectoryKey, RecordedTrajectory]
    volatile_keys: frozenset[str] = frozenset()
    rebuild: Callable[[str, str, Any], Any] | None = None  # (name, kind, JSON output) -> value


@dataclass(frozen=True)
class Played:
    """What a call got: ``served`` (``output`` is the recorded one), else it runs live; ``reason``
    when this call made its trajectory diverge; ``error`` to raise (``on_diverge="fail"``)."""

    served: bool
    output: Any = None
    reason: str | None = None
    error: ReplayDivergence | None = None


_NOT_SERVED = Played(False)


@dataclass
class TrajectoryReplay:
    """One open trajectory's replay state (kept on its ``OpenTrajectory``)."""

    source: RecordedTrajectory | None
    cassette: Cassette
    calls: dict[str, int] = field(default_factory=dict)
    played: set[tuple[str, int]] = field(default_factory=set)  # (kind, position) served
    served: int = 0
    reason: str | None = None  # why it diverged

    @property
    def diverged(self) -> bool:
        return self.reason is not None

    @property
    def status(self) -> str:
        if self.source is None:
            return LIVE
        return DIVERGED if self.diverged else SERVED

    def attributes(self) -> dict[str, Any]:
        """The trajectory root's replay attributes."""
        attrs = {STATUS_KEY: self.status, SOURCE_KEY: self.source.id if self.source else None}
        if self.reason is not None:
            attrs[REASON_KEY] = self.reason
        return attrs


class Cassette:
    """The recorded trajectories a replay serves from, by key (``rlreplay.playback`` builds one).

    ``recording`` is a :class:`Recording`, or a function giving one on first use (so that a process
    that never opens a trajectory never reads the source run; if it fails, every trajectory runs
    live). ``match_on``: matcher names of ``rlreplay.recorder.matchers.MATCHERS``, or functions.
    """

    def __init__(
        self,
        kinds: Iterable[str],
        recording: Recording | Callable[[], Recording],
        on_diverge: str = "live",
        match_on: Iterable[str | Matcher] = DEFAULT_MATCH_ON,
    ) -> None:
        if on_diverge not in ON_DIVERGE:
            raise ValueError(f"on_diverge must be one of {ON_DIVERGE}, not {on_diverge!r}")
        self.kinds = frozenset(kinds)
        self.on_diverge = on_diverge
        self.matchers = matchers(match_on)
        self._by_position = position in self.matchers  # then one recorded op is a candidate
        self._recording = recording if isinstance(recording, Recording) else None
        self._load = None if isinstance(recording, Recording) else recording
        self._lock = threading.Lock()
        self.asked: set[TrajectoryKey] = set()
        self.served = 0
        self.divergences: dict[str, str] = {}  # source trajectory id -> why it diverged
        self._served_meta: dict[int, Any] = {}

    @property
    def recording(self) -> Recording:
        if self._recording is None:
            with self._lock:
                if self._recording is None:
                    try:
                        self._recording = self._load() if self._load is not None else Recording({})
                    except Exception as exc:  # never raise into the job: its trajectories run live
                        log.warning("rlreplay: cannot read the replay's source run (%s); running live", exc)
                        self._recording = Recording({})
        return self._recording

    @property
    def trajectories(self) -> dict[TrajectoryKey, RecordedTrajectory]:
        return self.recording.trajectories

    @property
    def diverged(self) -> list[str]:
        """Source ids of the trajectories that diverged."""
        return list(self.divergences)

    def open(self, key: TrajectoryKey) -> TrajectoryReplay:
        """The replay state of a trajectory opening with ``key`` (its experiment is not matched)."""
        key = key.without_experiment()
        recording = self.recording
        source = recording.trajectories.get(key)
        if source is not None:
            self.asked.add(key)
            if not source.prepared:
                for ops in source.ops.values():
                    for op in ops:
                        op.inputs = comparable(op.inputs, recording.volatile_keys)
                source.prepared = True
        return TrajectoryReplay(source, self)

    def never_asked(self) -> list[str]:
        """Ids of recorded trajectories no trajectory of this process asked for."""
        return [t.id for k, t in self.trajectories.items() if k not in self.asked]

    def play(self, state: TrajectoryReplay, kind: str, name: str, inputs: Any) -> Played:
        """Serve a call of ``state``'s trajectory (``inputs``: JSON values) from the recording."""
        if state.source is None or state.diverged:
            return _NOT_SERVED
        k = state.calls.get(kind, 0)
        state.calls[kind] = k + 1
        recording = self.recording
        call = Call(kind, name, comparable(inputs, recording.volatile_keys), k)
        recorded = state.source.ops.get(kind, [])
        if self._by_position:  # only the op at the call's position can match
            candidates = recorded[k : k + 1]
        else:
            candidates = [op for op in recorded if (kind, op.position) not in state.played]
        reason = None
        for op in candidates:
            why = mismatch(op, call, self.matchers)
            if why is None:
                played = self._output(op, call)
                if played.served:
                    state.played.add((kind, op.position))
                    state.served += 1
                    with self._lock:
                        self.served += 1
                    return played
                why = played.reason
            reason = reason or why
        if reason is None:
            reason = f"{name} call {k + 1} of kind {kind!r}: the recording has {len(recorded)}"
        state.reason = reason
        with self._lock:
            self.divergences[state.source.id] = reason
        if self.on_diverge == "fail":
            error = ReplayDivergence(f"replay of trajectory {state.source.id} diverged: {reason}")
            return Played(False, reason=reason, error=error)
        return Played(False, reason=reason)

    def _output(self, op: RecordedOp, call: Call) -> Played:
        """``op``'s recorded output, a fresh copy in the framework's type; not served (and why) when
        the adapter cannot rebuild it."""
        output = fresh_copy(op.output)
        rebuild = self.recording.rebuild
        if rebuild is None:
            return Played(True, output)
        try:
            return Played(True, rebuild(op.name, call.kind, output))
        except Exception as exc:  # never raised into the job: the call runs live
            return Played(
                False,
                reason=f"{call.name} call {call.position + 1}: the recorded output of span {op.span_id} "
                f"cannot be rebuilt ({type(exc).__name__}: {_first_line(exc)})",
            )

    # -- the recorder's side ----------------------------------------------------------------------

    def serve(self, state: TrajectoryReplay, meta: Any, args: tuple, kwargs: dict) -> tuple[Played, Any]:
        """A traced call (``meta``: its ``rlreplay.recorder.events.OpMeta``) played with its inputs
        as the recording kept them; and the ``OpMeta`` to record its span with (served: marked
        so; diverged here: marked with the reason)."""
        if state.source is None or state.diverged:
            return _NOT_SERVED, meta
        bound = meta.bind(args, kwargs)
        if meta.reduce_inputs is not None:  # as the recording kept them
            bound = meta.reduce_inputs(bound)
        played = self.play(state, meta.kind, meta.name, payload.to_jsonable(bound))
        if played.served:
            return played, self._served_mark(meta)
        if played.reason is not None:
            return played, replace(meta, attributes={STATUS_KEY: DIVERGED, REASON_KEY: played.reason})
        return played, meta

    def _served_mark(self, meta: Any) -> Any:
        found = self._served_meta.get(id(meta))
        if found is None:
            found = replace(meta, attributes={STATUS_KEY: SERVED})
            found.__dict__["_origin"] = meta  # keeps ``id(meta)`` from being reused
            self._served_meta[id(meta)] = found
        return found


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
