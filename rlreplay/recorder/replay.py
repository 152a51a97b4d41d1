"""Serving recorded ops: a cassette of recorded trajectories answers calls from them, by matchers.

Inside a trajectory whose key matches a recorded one, a call of a served kind is served the
recorded output of the op that every matcher of ``match_on`` accepts (default: the same position
among the calls of its kind, the same name, the same inputs without the adapter's volatile keys;
``rlreplay.recorder.matchers``). A served value is what the op returned, bit for bit (rebuilt from
its JSON form and type record by the recording's framework adapter); a recorded output that does
not give it back (truncated, hidden by redaction, a type nobody rebuilds) is not served. When no
recorded op serves a call, the trajectory has *diverged*, for the reason given: with
``on_diverge="live"`` that call and every later one run live, with ``"fail"`` the call raises
:class:`ReplayDivergence`. The reason is kept on the trajectory (``reason``) and on the cassette
(``divergences``). A source that cannot be read (in full) serves nothing it cannot vouch for: the
trajectories it may hold diverge at their first served call, and ``problems`` says why.

A :class:`Cassette` takes plain calls (kind, name, the call's arguments: :meth:`Cassette.play`), so
that anything answering calls from a recording uses it; the recorder's wrapper binds a call's
arguments first (:meth:`Cassette.serve`). The recorder's hot path pays one check of a module
global when no replay is on.
"""

from __future__ import annotations

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


@dataclass
class RecordedTrajectory:
    id: str
    ops: dict[str, list[RecordedOp]]  # by kind, in call order (``position`` = index)
    prepared: bool = False  # inputs without the volatile keys


@dataclass
class Recording:
    """What a cassette serves from: recorded trajectories by key (experiment aside), and what the
    framework adapter of the recording says: its volatile keys and how to rebuild an output
    (``rebuild(name, kind, JSON output, type record)``; None: ``payload.from_json``).

    ``unreadable``: selected trajectories whose spans could not be read (key -> why);
    ``problem``: why the selection may hold more than was read (files that could not be read), so
    that a trajectory not found cannot be said to be absent from the source."""

    trajectories: dict[TrajectoryKey, RecordedTrajectory]
    volatile_keys: frozenset[str] = frozenset()
    rebuild: Callable[[str, str, Any, dict[str, str] | None], Any] | None = None
    unreadable: dict[TrajectoryKey, str] = field(default_factory=dict)
    problem: str | None = None


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
    #: it diverged on opening (its source could not be read): said at its first served call
    unsaid: bool = False

    @property
    def diverged(self) -> bool:
        return self.reason is not None

    @property
    def status(self) -> str:
        if self.diverged:
            return DIVERGED
        return LIVE if self.source is None else SERVED

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
        self._unread = False  # the source could not be read at all
        self._lock = threading.Lock()
        self.asked: set[TrajectoryKey] = set()
        self.served = 0
        self.divergences: dict[str, str] = {}  # source trajectory id -> why it diverged
        self.problems: list[str] = []  # why the source could not be read (in full)
        self._served_meta: dict[int, Any] = {}

    @property
    def recording(self) -> Recording:
        if self._recording is None:
            with self._lock:
                if self._recording is None:
                    try:
                        self._recording = self._load() if self._load is not None else Recording({})
                    except Exception as exc:  # never raised into the job: its trajectories diverge
                        problem = (
                            f"the source run could not be read ({_first_line(exc) or type(exc).__name__})"
                        )
                        self._recording = Recording({}, problem=problem)
                        self._unread = True
                    if self._recording.problem is not None:
                        self.problems.append(self._recording.problem)
                        log.warning(
                            "rlreplay: replay: %s; the trajectories it may hold are not served (%s)",
                            self._recording.problem,
                            "their first served call raises"
                            if self.on_diverge == "fail"
                            else "they run live",
                        )
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
        if source is None:
            why = recording.unreadable.get(key)
            if why is None and recording.problem is not None:
                why = (
                    recording.problem if self._unread else f"not found in the source, and {recording.problem}"
                )
            if why is not None:
                self.asked.add(key)
                return TrajectoryReplay(None, self, reason=why, unsaid=True)
            return TrajectoryReplay(None, self)
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

    def as_recorded(self, inputs: Any) -> Any:
        """A call's ``inputs`` (values) as the recording keeps them, to be matched: redacted, what
        JSON cannot hold (integers beyond 64 bits, lone surrogates) written as the recording wrote
        it, its volatile keys left out."""
        written = payload.decode(payload.dumps(payload.to_payload(inputs)[0]))
        return comparable(written, self.recording.volatile_keys)

    def play(self, state: TrajectoryReplay, kind: str, name: str, inputs: Any) -> Played:
        """Serve a call of ``state``'s trajectory from the recording. ``inputs``: the call's
        arguments as values (a dict of them); they are matched in the form the recording keeps
        them (``rlreplay.format.payload.to_payload``: redacted, markers, an op's ``__type__`` dicts
        wrapped)."""
        if state.unsaid:  # its source could not be read: said by its first served call
            state.unsaid = False
            return self._diverged(state, state.reason or "")
        if state.source is None or state.diverged:
            return _NOT_SERVED
        k = state.calls.get(kind, 0)
        state.calls[kind] = k + 1
        call = Call(kind, name, self.as_recorded(inputs), k)
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
        return self._diverged(state, reason)

    def _diverged(self, state: TrajectoryReplay, reason: str) -> Played:
        state.reason = reason
        with self._lock:
            if state.source is not None:
                self.divergences[state.source.id] = reason
        if self.on_diverge == "fail":
            which = state.source.id if state.source is not None else "(not read from the source)"
            error = ReplayDivergence(f"replay of trajectory {which} diverged: {reason}")
            return Played(False, reason=reason, error=error)
        return Played(False, reason=reason)

    def _output(self, op: RecordedOp, call: Call) -> Played:
        """``op``'s recorded output made anew, as the op returned it (the recording's adapter
        rebuilds its types); not served, and why, when the recording does not give it back."""
        rebuild = self.recording.rebuild
        try:
            if rebuild is None:
                return Played(True, payload.from_json(op.output, op.output_type))
            return Played(True, rebuild(op.name, call.kind, op.output, op.output_type))
        except payload.NotExact as exc:  # never raised into the job: the call runs live
            why = f"is not what the op returned: {exc}"
        except Exception as exc:
            why = f"cannot be rebuilt ({type(exc).__name__}: {_first_line(exc)})"
        return Played(
            False,
            reason=f"{call.name} call {call.position + 1}: the recorded output of span {op.span_id} {why}",
        )

    # -- the recorder's side ----------------------------------------------------------------------

    def serve(self, state: TrajectoryReplay, meta: Any, args: tuple, kwargs: dict) -> tuple[Played, Any]:
        """A traced call (``meta``: its ``rlreplay.recorder.events.OpMeta``) played with its inputs
        as the recording kept them; and the ``OpMeta`` to record its span with (served: marked
        so; diverged here: marked with the reason)."""
        if (state.source is None or state.diverged) and not state.unsaid:
            return _NOT_SERVED, meta
        bound = meta.bind(args, kwargs)
        if meta.reduce_inputs is not None:  # as the recording kept them
            bound = meta.reduce_inputs(bound)
        played = self.play(state, meta.kind, meta.name, bound)
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
