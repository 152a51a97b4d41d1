"""Serving recorded ops: inside a trajectory whose keys match a recorded one, an op of a served kind
returns its recorded output instead of running.

The k-th op of a served kind in a trajectory is matched to the k-th recorded op of that kind; it is
served only when its inputs equal the recorded ones (per-call ids such as ``request_id`` aside).
The first mismatch makes the trajectory *diverged*: with ``on_diverge="live"`` that op and every
later one run live, with ``"fail"`` the op raises :class:`ReplayDivergence`. The recorder's hot path
pays one check of a module global when no replay is on.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rlreplay.errors import ReplayDivergence
from rlreplay.format import payload

log = logging.getLogger("rlreplay")
ON_DIVERGE = ("live", "fail")
#: Input keys that are fresh on every run by design (uuids), at any depth: never compared.
IGNORED_KEYS = frozenset({"request_id", "instance_id"})

SERVED = "served"
DIVERGED = "diverged"
LIVE = "live"


def comparable(value: Any, ignored: frozenset[str] = IGNORED_KEYS) -> Any:
    """``value`` without the keys (at any depth) that differ on every run."""
    if isinstance(value, dict):
        return {k: comparable(v, ignored) for k, v in value.items() if k not in ignored}
    if isinstance(value, (list, tuple)):
        if _SCALARS.issuperset(map(type, value)):  # token ids, log-probs: as they are
            return list(value)
        return [comparable(v, ignored) for v in value]
    return value


_SCALARS = frozenset({int, float, str, bool, type(None)})


def fresh_copy(value: Any) -> Any:
    """A copy of a recorded (JSON) value that the caller may change; scalars as they are."""
    if isinstance(value, dict):
        return {k: fresh_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        if _SCALARS.issuperset(map(type, value)):
            return list(value)
        return [fresh_copy(v) for v in value]
    return copy.copy(value) if type(value) not in _SCALARS else value


@dataclass
class RecordedOp:
    span_id: str
    name: str
    inputs: Any
    output: Any


@dataclass
class RecordedTrajectory:
    id: str
    ops: dict[str, list[RecordedOp]]  # by kind, in call order


@dataclass
class TrajectoryReplay:
    """One open trajectory's replay state (kept on its ``OpenTrajectory``)."""

    source: RecordedTrajectory | None
    cassette: Cassette
    calls: dict[str, int] = field(default_factory=dict)
    served: int = 0
    diverged: bool = False

    @property
    def status(self) -> str:
        if self.source is None:
            return LIVE
        return DIVERGED if self.diverged else SERVED

    def attributes(self) -> dict[str, Any]:
        return {"replay": self.status, "replay_of": self.source.id if self.source else None}


Keys = tuple[Any, Any, Any, bool]


def normal_keys(step: Any, sample_index: Any, rollout_n: Any, validate: Any) -> Keys:
    """Keys as a listing reads them back: an integer where the value is one, else its text."""

    def one(value: Any) -> Any:
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        text = str(value)
        try:
            return int(text) if text.strip() == text and str(int(text)) == text else text
        except ValueError:
            return text

    return (one(step), one(sample_index), one(rollout_n), bool(validate))


class Cassette:
    """The recorded trajectories a replay serves from, by keys; built by ``rlreplay.replay``.

    ``load`` (optional) fills ``trajectories`` on first use, so that a process that never opens a
    trajectory never reads the source run. ``rebuild(name, kind, output)`` turns a recorded output
    back into the framework's own type (default: the JSON value as recorded).
    """

    def __init__(
        self,
        kinds: tuple[str, ...],
        on_diverge: str = "live",
        trajectories: dict[Keys, RecordedTrajectory] | None = None,
        load: Callable[[], dict[Keys, RecordedTrajectory]] | None = None,
        rebuild: Callable[[str, str, Any], Any] | None = None,
    ) -> None:
        if on_diverge not in ON_DIVERGE:
            raise ValueError(f"on_diverge must be one of {ON_DIVERGE}, not {on_diverge!r}")
        self.kinds = frozenset(kinds)
        self.on_diverge = on_diverge
        self._trajectories = trajectories
        self.load = load
        self._lock = threading.Lock()
        self.rebuild = rebuild
        self.asked: set[Keys] = set()
        self.served = 0
        self.diverged: list[str] = []
        self._served_meta: dict[int, Any] = {}

    @property
    def trajectories(self) -> dict[Keys, RecordedTrajectory]:
        if self._trajectories is None:
            with self._lock:
                if self._trajectories is None:
                    try:
                        self._trajectories = self.load() if self.load is not None else {}
                    except Exception as exc:  # never raise into the job: its trajectories run live
                        log.warning("rlreplay: cannot read the replay's source run (%s); running live", exc)
                        self._trajectories = {}
        return self._trajectories

    def open(self, step: Any, sample_index: Any, rollout_n: Any, validate: Any) -> TrajectoryReplay:
        keys = normal_keys(step, sample_index, rollout_n, validate)
        source = self.trajectories.get(keys)
        if source is not None:
            self.asked.add(keys)
        return TrajectoryReplay(source, self)

    def never_asked(self) -> list[str]:
        """Ids of recorded trajectories no trajectory of this process asked for."""
        return [t.id for k, t in self.trajectories.items() if k not in self.asked]

    def served_meta(self, meta: Any) -> Any:
        """``meta`` with the attribute that marks a served span."""
        found = self._served_meta.get(id(meta))
        if found is None:
            found = replace(meta, attributes={"replay": SERVED})
            found.__dict__["_origin"] = meta  # keeps ``id(meta)`` from being reused
            self._served_meta[id(meta)] = found
        return found

    def serve(self, state: TrajectoryReplay, meta: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(True, the recorded output) when this call is served; (False, None) when it runs live."""
        if state.source is None or state.diverged:
            return False, None
        k = state.calls.get(meta.kind, 0)
        state.calls[meta.kind] = k + 1
        recorded = state.source.ops.get(meta.kind, [])
        reason = None
        if k >= len(recorded):
            reason = f"{meta.name} call {k + 1} of kind {meta.kind!r}: the recording has {len(recorded)}"
        else:
            op = recorded[k]
            bound = meta.bind(args, kwargs)
            if meta.reduce_inputs is not None:  # as the recording kept them
                bound = meta.reduce_inputs(bound)
            inputs = comparable(payload.to_jsonable(bound))
            if op.name != meta.name:
                reason = f"{meta.kind} call {k + 1} is {meta.name}, recorded {op.name}"
            elif inputs != comparable(op.inputs):
                reason = f"{meta.name} call {k + 1} has other inputs than recorded span {op.span_id}"
        if reason is not None:
            state.diverged = True
            with self._lock:
                self.diverged.append(state.source.id)
            if self.on_diverge == "fail":
                raise ReplayDivergence(f"replay of trajectory {state.source.id} diverged: {reason}")
            return False, None
        state.served += 1
        with self._lock:
            self.served += 1
        output = fresh_copy(op.output)
        if self.rebuild is not None:
            output = self.rebuild(meta.name, meta.kind, output)
        return True, output
