"""Answering proxied calls from a recording, through the replay cassette (``Cassette.play``: the
same matching as ``rlreplay replay``).

A call that names its trajectory's keys is served from the recorded trajectory with those keys. A
call that opens a trajectory without keys is served from the first recorded trajectory, not yet
taken, whose first model call the cassette's matchers accept for it (its keys are then the
replayed trajectory's keys, so that ``compare`` pairs them); later calls join it by continuation.
"""

from __future__ import annotations

from typing import Any

from rlreplay.format.keys import TrajectoryKey
from rlreplay.format.schema import KIND_LLM
from rlreplay.format.wire import canonical_json
from rlreplay.recorder.matchers import Call, RecordedOp, comparable, mismatch
from rlreplay.recorder.replay import Cassette, Played, TrajectoryReplay


def _digest(inputs: Any) -> bytes:
    return canonical_json(inputs)


class ProxyReplay:
    """A cassette of recorded proxy trajectories and which of them replayed trajectories took."""

    def __init__(self, cassette: Cassette) -> None:
        self.cassette = cassette
        self.volatile = cassette.recording.volatile_keys
        self.taken: set[TrajectoryKey] = set()
        self.refused = 0  # calls answered 409 (--on-diverge fail)
        self._by_first: dict[bytes, list[TrajectoryKey]] | None = None
        self._prompt_ids: dict[TrajectoryKey, list[Any]] = {}

    def recorded_keys(self) -> list[TrajectoryKey]:
        return list(self.cassette.trajectories)

    def _first_calls(self) -> dict[bytes, list[TrajectoryKey]]:
        if self._by_first is None:
            self._by_first = {}
            for key, source in self.cassette.trajectories.items():
                ops = source.ops.get(KIND_LLM) or []
                if ops:
                    digest = _digest(comparable(ops[0].inputs, self.volatile))
                    self._by_first.setdefault(digest, []).append(key)
        return self._by_first

    def source_for(self, name: str, inputs: dict[str, Any]) -> TrajectoryKey | None:
        """The key of the first untaken recorded trajectory whose first call ``inputs`` match."""
        call = Call(KIND_LLM, name, self.cassette.as_recorded(inputs), 0)
        for key in self._first_calls().get(_digest(call.inputs), ()):
            if key in self.taken:
                continue
            op = self.cassette.trajectories[key].ops[KIND_LLM][0]
            candidate = RecordedOp(op.span_id, op.name, comparable(op.inputs, self.volatile), op.output, 0)
            if mismatch(candidate, call, self.cassette.matchers) is None:
                return key
        return None

    def open(self, key: TrajectoryKey) -> TrajectoryReplay:
        """The replay state of a trajectory with ``key`` (live when the recording has none)."""
        key = key.without_experiment()
        source = self.cassette.trajectories.get(key)
        if source is not None and key not in self._prompt_ids:
            # the prompt ids the upstream gave, kept before the cassette drops them (volatile)
            ops = source.ops.get(KIND_LLM) or []
            self._prompt_ids[key] = [
                op.inputs.get("prompt_ids") if isinstance(op.inputs, dict) else None for op in ops
            ]
        self.taken.add(key)
        return self.cassette.open(key)

    def play(self, state: TrajectoryReplay, name: str, inputs: dict[str, Any]) -> Played:
        return self.cassette.play(state, KIND_LLM, name, inputs)

    def recorded_prompt_ids(self, key: TrajectoryKey, state: TrajectoryReplay) -> Any:
        """The prompt ids recorded with the call ``state`` just served."""
        position = state.calls.get(KIND_LLM, 0) - 1
        found = self._prompt_ids.get(key.without_experiment()) or []
        return found[position] if 0 <= position < len(found) else None

    def refuse(self) -> None:
        """Count a call answered 409: in the stop line, and as ``refused_calls`` in ``rlreplay info``."""
        self.refused += 1
        from rlreplay.recorder.api import get_recorder

        rec = get_recorder()
        if rec is not None:
            rec.count_loss(
                "refused_calls", 1, "refused", "replay: a call the recording does not hold was refused (409)"
            )

    def summary(self) -> str:
        cassette = self.cassette
        diverged = cassette.diverged
        never = cassette.never_asked()
        return (
            f"{cassette.served} calls served; {len(diverged)} trajectories diverged"
            + (f" ({', '.join(diverged[:5])}{' ...' if len(diverged) > 5 else ''})" if diverged else "")
            + f"; {len(never)} recorded trajectories never asked for"
            + (f" ({', '.join(never[:5])}{' ...' if len(never) > 5 else ''})" if never else "")
            + f"; {self.refused} calls refused (409)"
        )
