"""Which trajectory and step a proxied call belongs to, and recording them as an ordinary run.

A call joins a trajectory by what the proxy can know, in this order:

1. ``X-Rlreplay-Trajectory-Id: ID``, the header every answer carries, sent back: the trajectory
   with that id (an id this proxy never gave is refused, 404). Only this, or keys, tells rollouts
   apart whose calls are alike.
2. Keys: the ``X-Rlreplay-Trajectory`` header (or the OpenAI ``metadata`` key
   ``rlreplay_trajectory``), ``step=3,sample_index=12,rollout_n=0,validate=false``: every call
   naming the same keys joins one trajectory.
3. Continuation: a call whose prompt extends a trajectory's last prompt + answer (chat messages,
   completion text, token ids) joins it. When several trajectories have that same history (a group
   of rollouts answered alike), nothing in the call says which rollout sent it: it joins the one
   that has waited longest. Each trajectory still holds one rollout's calls (their histories are
   equal), but a rollout's id may then change from one answer to the next: such joins are counted
   (``ambiguous``), and a client that posts signals by an earlier answer's id sends the id back (1).
4. Otherwise a new trajectory: ``step`` the proxy's step, ``sample_index`` ``auto-N`` (a counter
   per step). Named keys never take the ``auto-`` form, so the two never meet.

Closing is about writing, not identity: a trajectory is written (its spans and a root span) when
it has been idle for ``idle_s``, when signals are posted for it, and when the proxy stops; a later
call that joins it (by any rule above) appends to the same id and keys, and readers merge the
parts. The last ``KEPT`` written trajectories stay joinable. A call the upstream never answered
leaves no trajectory behind.

Steps advance on weight updates that pass through (consecutive updates with no generation between
them count once) or ``POST /rlreplay/step``. Spans go to the recorder through a hand-off
(``rlreplay.proxy.handoff``): the proxy's event loop never encodes spans or waits for the disk.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from rlreplay.errors import KeyTextError, ProxyError, ReplayDivergence, UnknownTrajectory
from rlreplay.format.keys import FIELDS, KEYS, TrajectoryKey, parse_int
from rlreplay.format.schema import KIND_LLM, KIND_TRAJECTORY
from rlreplay.format.wire import canonical_json
from rlreplay.proxy.handoff import Handoff
from rlreplay.proxy.protocol import CHAT, answer_of, prompt_of
from rlreplay.recorder import events
from rlreplay.recorder.events import OPEN, OPEN_BYTES, Control, OpenTrajectory, OpMeta, SpanEvent
from rlreplay.recorder.signals import record_signals

HEADER = "X-Rlreplay-Trajectory"
ID_HEADER = "X-Rlreplay-Trajectory-Id"  # on every answer; a client may send it back
METADATA_KEY = "rlreplay_trajectory"
AUTO = "auto-"  # the sample_index of a trajectory no call named: auto-0, auto-1, ...
KEPT = 100_000  # written trajectories that stay joinable (and take signals)


def auto_number(value: Any) -> int | None:
    """N of a sample_index ``auto-N``, else None."""
    if isinstance(value, str) and value.startswith(AUTO):
        return parse_int(value[len(AUTO) :])
    return None


def parse_key(text: str) -> TrajectoryKey:
    """The keys a call names (``TrajectoryKey.parse``), with the proxy's rules: no ``auto-N``
    values (the proxy's own) and no experiment (the proxy's ``--experiment-name``); raises
    ProxyError naming what is wrong."""
    try:
        key = TrajectoryKey.parse(text)
    except KeyTextError as exc:
        raise ProxyError(f"{HEADER}: {exc}") from None
    if key.experiment is not None:
        raise ProxyError(f"{HEADER}: experiment is the proxy's own, not a call's")
    for name in KEYS:
        value = getattr(key, name)
        if isinstance(value, str) and value.startswith(AUTO):
            raise ProxyError(f"{HEADER}: {name}={value!r}: values {AUTO}N are the proxy's own")
    return key


def key_text(headers: Any, body: dict[str, Any]) -> str | None:
    """The trajectory key a request names: its header, else its OpenAI ``metadata``."""
    found = headers.get(HEADER)
    if found:
        return found
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get(METADATA_KEY), str):
        return metadata[METADATA_KEY]
    return None


# ---- continuation ---------------------------------------------------------------------------------


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(canonical_json(part).decode())
        return "".join(parts)
    return canonical_json(content).decode()


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return canonical_json(value).decode()


def normal_message(message: Any) -> tuple:
    """A chat message as continuation compares it: role, text, tool calls (name, arguments as
    JSON), the tool call it answers; ids, refusals and other extras aside."""
    if not isinstance(message, dict):
        return ("?", _text(message), (), None)
    calls = []
    calls_made = message.get("tool_calls")
    for call in calls_made if isinstance(calls_made, list) else ():
        fn = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else {}
        calls.append((fn.get("name"), _arguments(fn.get("arguments"))))
    return (message.get("role"), _text(message.get("content")), tuple(calls), message.get("tool_call_id"))


def prompt_sequence(route: str, body: dict[str, Any]) -> tuple[str, Any] | None:
    """(kind, sequence) of a request's prompt: normalised chat messages, text, or token ids."""
    prompt = prompt_of(route, body)
    if route == CHAT:
        if isinstance(prompt, list):
            return "chat", tuple(normal_message(m) for m in prompt)
        return None
    if isinstance(prompt, str):
        return "text", prompt
    if isinstance(prompt, list) and prompt and all(type(v) is int for v in prompt):
        return "ids", tuple(prompt)
    return None


def context_sequence(
    route: str, body: dict[str, Any], record: dict[str, Any], chunks: list[Any] | None = None
) -> tuple[str, Any] | None:
    """(kind, sequence) a later call's prompt starts with when it continues this call: the prompt
    and the first choice's answer (``chunks``: a streamed answer's, as :func:`answer_of`)."""
    prompt = prompt_sequence(route, body)
    if prompt is None:
        return None
    kind, sequence = prompt
    answer = answer_of(route, record, chunks)
    if kind == "chat":
        return (kind, (*sequence, normal_message(answer))) if isinstance(answer, dict) else None
    if not isinstance(answer, dict):
        return None
    if kind == "text" and isinstance(answer.get("text"), str):
        return kind, sequence + answer["text"]
    if kind == "ids" and isinstance(answer.get("ids"), list):
        return kind, (*sequence, *answer["ids"])
    return None


#: Where a later call finds the call it continues: (kind, length of the sequence, its digest).
Context = tuple[str, int, bytes]


def context_key(
    route: str, body: dict[str, Any], record: dict[str, Any], chunks: list[Any] | None = None
) -> Context | None:
    """The :data:`Context` of :func:`context_sequence`."""
    context = context_sequence(route, body, record, chunks)
    return None if context is None else context_of(*context)


def context_of(kind: str, sequence: Any) -> Context:
    """The :data:`Context` of a (kind, sequence) a later call's prompt may start with."""
    return kind, len(sequence), _digest(sequence)


def _digest(sequence: Any) -> bytes:
    return hashlib.blake2b(canonical_json(sequence), digest_size=16).digest()


class ContinuationIndex:
    """Trajectories by the prompt + answer a continuing call's prompt starts with (a digest of
    it: written trajectories stay here at little cost). Several may share one (a group of rollouts
    of one prompt answered alike): a continuing call takes the one that has waited longest."""

    def __init__(self) -> None:
        self._by_length: dict[tuple[str, int], dict[bytes, list[ProxyTrajectory]]] = {}

    def add(self, context: Context, traj: ProxyTrajectory) -> None:
        self.remove(traj)
        kind, length, digest = context
        self._by_length.setdefault((kind, length), {}).setdefault(digest, []).append(traj)
        traj.context = context

    def remove(self, traj: ProxyTrajectory) -> None:
        if traj.context is None:
            return
        kind, length, digest = traj.context
        traj.context = None
        bucket = self._by_length.get((kind, length))
        waiting = bucket.get(digest) if bucket is not None else None
        if not waiting:
            return
        with contextlib.suppress(ValueError):
            waiting.remove(traj)
        if not waiting:
            del bucket[digest]
            if not bucket:
                del self._by_length[(kind, length)]

    def claim(self, prompt: tuple[str, Any]) -> tuple[ProxyTrajectory | None, bool]:
        """The trajectory whose context ``prompt`` extends (the longest), taken out of the index,
        and whether others had that same context."""
        kind, sequence = prompt
        lengths = sorted((n for k, n in self._by_length if k == kind and n < len(sequence)), reverse=True)
        for n in lengths:
            waiting = self._by_length[(kind, n)].get(_digest(sequence[:n]))
            if waiting:
                traj = waiting[0]
                ambiguous = len(waiting) > 1
                self.remove(traj)
                return traj, ambiguous
        return None, False


# ---- trajectories -----------------------------------------------------------------------------------


@dataclass(eq=False)
class ProxyTrajectory:
    """One trajectory of proxied calls, written in parts (a root span each) as it closes."""

    key: TrajectoryKey
    explicit: bool
    replay: Any = None  # its replay state (rlreplay.recorder.replay.TrajectoryReplay)
    open: OpenTrajectory | None = None  # its id: made on first need
    root_span: int = 0  # the root span of the part being recorded
    start_ns: int = 0
    last_used: float = field(default_factory=time.monotonic)
    spans: int = 0  # spans of the part being recorded
    context: Context | None = None
    busy: int = 0  # calls in flight
    closed: bool = False
    first_root: str | None = None  # the first written part's root span (signals point at it)

    @property
    def id(self) -> str | None:
        return events.format_trajectory_id(self.open.id) if self.open is not None else None


_ROOT_META = OpMeta(name="trajectory", kind=KIND_TRAJECTORY)


class Trajectories:
    """The proxy's trajectories (open, and the last ``KEPT`` written), its step, and the recorder
    they are written with."""

    def __init__(self, recorder: Any, idle_s: float = 300.0, experiment: str | None = None) -> None:
        self.recorder = recorder
        self.handoff = Handoff(recorder) if recorder is not None else None
        self.idle_s = idle_s
        self.experiment = experiment
        self.step = 0
        self.ambiguous = 0  # calls joined to one of several trajectories with the same history
        self._generated_since_update = False
        self._counters: dict[Any, itertools.count] = {}
        self._first_free: dict[Any, int] = {}
        self.by_key: dict[TrajectoryKey, ProxyTrajectory] = {}
        self.by_id: dict[str, ProxyTrajectory] = {}
        self.open: set[ProxyTrajectory] = set()
        self.written: OrderedDict[ProxyTrajectory, None] = OrderedDict()
        self.index = ContinuationIndex()
        self._metas: dict[tuple[str, str | None, str | None], OpMeta] = {}

    # -- steps ----------------------------------------------------------------------------------

    def weights_updated(self) -> None:
        """A weight update passed through: the next generation is of the next step."""
        if self._generated_since_update:
            self.step += 1
            self._generated_since_update = False

    def set_step(self, step: int | None) -> int:
        self.step = self.step + 1 if step is None else step
        self._generated_since_update = False
        return self.step

    def reserve(self, step: Any, sample_index: Any) -> None:
        """Counters of new trajectories at ``step`` start after ``sample_index`` (a replay's source
        keys are taken)."""
        number = auto_number(sample_index)
        if number is not None:
            self._first_free[step] = max(self._first_free.get(step, 0), number + 1)

    def new_key(self) -> TrajectoryKey:
        counter = self._counters.get(self.step)
        if counter is None:
            counter = self._counters[self.step] = itertools.count(self._first_free.get(self.step, 0))
        return TrajectoryKey.of(self.step, f"{AUTO}{next(counter)}", None, False)

    # -- which trajectory ---------------------------------------------------------------------------

    def find(
        self, route: str, body: dict[str, Any], named: TrajectoryKey | None, sent_id: str | None = None
    ) -> tuple[ProxyTrajectory, bool]:
        """The trajectory a call belongs to (``sent_id``: the id it sent back, ``named``: the keys
        it named), and whether it is new (not yet started). Raises UnknownTrajectory for an id this
        proxy never gave, ProxyError for an id and keys of two trajectories."""
        if sent_id:
            traj = self.by_id.get(sent_id)
            if traj is None:
                raise UnknownTrajectory(f"{ID_HEADER}: no trajectory of this proxy has the id {sent_id!r}")
            if named is not None and named != traj.key:
                raise ProxyError(f"{ID_HEADER} {sent_id} is trajectory {traj.key}, not {named}")
            self._generated_since_update = True
            self._resume(traj)
            return traj, False
        self._generated_since_update = True
        if named is not None:
            traj = self.by_key.get(named)
            if traj is None:
                traj = self.by_key[named] = ProxyTrajectory(named, explicit=True)
                self.open.add(traj)
                return traj, True
            self._resume(traj)
            return traj, False
        prompt = prompt_sequence(route, body)
        traj, ambiguous = self.index.claim(prompt) if prompt is not None else (None, False)
        if traj is not None:
            self.ambiguous += ambiguous
            self._resume(traj)
            return traj, False
        traj = ProxyTrajectory(TrajectoryKey(), explicit=False)
        self.open.add(traj)
        return traj, True

    def _resume(self, traj: ProxyTrajectory) -> None:
        """``traj`` takes a call: open again if it was written; out of the index until answered."""
        self.index.remove(traj)
        if traj.closed:
            traj.closed = False
            self.written.pop(traj, None)
            self.open.add(traj)

    def name(self, traj: ProxyTrajectory, key: TrajectoryKey | None = None) -> None:
        """Give a new unnamed trajectory its key (``key``: a replay's source key), else the next free one."""
        traj.key = key if key is not None else self.new_key()
        self.by_key.setdefault(traj.key, traj)

    def continues(
        self,
        traj: ProxyTrajectory,
        route: str,
        body: dict[str, Any],
        record: dict[str, Any],
        chunks: list[Any] | None = None,
    ) -> None:
        """After a call answered: later calls extending its prompt + answer join ``traj``
        (``chunks``: a streamed answer's, already read)."""
        if traj.explicit or not isinstance(record, dict):
            return
        self.continues_at(traj, context_key(route, body, record, chunks))

    def continues_at(self, traj: ProxyTrajectory, context: Context | None) -> None:
        """After a call answered: later calls whose prompt has ``context`` join ``traj``."""
        if context is not None and not traj.explicit and (traj in self.open or traj in self.written):
            self.index.add(context, traj)

    # -- recording ----------------------------------------------------------------------------------

    def _meta(self, name: str, status: str | None, reason: str | None) -> OpMeta:
        key = (name, status, reason)
        meta = self._metas.get(key)
        if meta is None:
            attributes = None
            if status is not None:
                from rlreplay.recorder.replay import REASON_KEY, STATUS_KEY

                attributes = {STATUS_KEY: status, **({REASON_KEY: reason} if reason else {})}
            meta = OpMeta(name=name, kind=KIND_LLM, attributes=attributes)
            if reason is None and len(self._metas) < 64:
                self._metas[key] = meta
        return meta

    def allocate(self, traj: ProxyTrajectory) -> str:
        """``traj``'s id (the recorder's trajectory, made on first need; written only with a span)."""
        if traj.open is None:
            traj.open = OpenTrajectory(replace(traj.key, experiment=self.experiment))
            self.by_id[events.format_trajectory_id(traj.open.id)] = traj
        return events.format_trajectory_id(traj.open.id)

    def record(
        self,
        traj: ProxyTrajectory,
        name: str,
        inputs: dict[str, Any],
        output: Any,
        start_ns: int,
        end_ns: int,
        status: str | None = None,
        reason: str | None = None,
        error: BaseException | None = None,
    ) -> None:
        """One generation of ``traj`` as an ``llm`` span (``status``/``reason``: a replay's mark)."""
        rec, handoff = self.recorder, self.handoff
        traj.last_used = time.monotonic()
        if rec is None or handoff is None:
            return
        try:
            if not traj.spans:  # the first span of a part: its root span comes when it closes
                self.allocate(traj)
                traj.root_span = next(events.span_ids)
                traj.start_ns = start_ns
                handoff.give(Control(OPEN, traj.open, OPEN_BYTES))
            span_id = next(events.span_ids)
            nbytes = events.payload_bytes((), inputs, output)
            meta = self._meta(name, status, reason)
            handoff.give(
                SpanEvent(
                    traj.open,
                    span_id,
                    traj.root_span,
                    meta,
                    start_ns,
                    end_ns,
                    error,
                    (),
                    inputs,
                    output,
                    nbytes,
                )
            )
            traj.spans += 1
        except Exception as exc:  # recording never breaks the answer
            with contextlib.suppress(Exception):
                rec.count_loss("lost", 1, "proxy", f"could not record a call ({type(exc).__name__}: {exc})")

    def close(self, traj: ProxyTrajectory) -> None:
        """Write the part of ``traj`` recorded since it last closed (its root span); it stays
        joinable while it is among the last ``KEPT`` written."""
        if traj.closed:
            return
        self.open.discard(traj)
        traj.closed = True
        if traj.spans and self.recorder is not None and self.handoff is not None:
            error = None
            if traj.replay is not None:
                traj.open.attributes = {**(traj.open.attributes or {}), **traj.replay.attributes()}
                error = replay_error(traj.replay)
            end = time.time_ns()
            with contextlib.suppress(Exception):
                self.handoff.give(
                    SpanEvent(
                        traj.open,
                        traj.root_span,
                        None,
                        _ROOT_META,
                        traj.start_ns,
                        end,
                        error,
                        (),
                        {},
                        None,
                        256,
                    )
                )
                self.recorder.wake()
            traj.first_root = traj.first_root or events.format_span_id(traj.root_span)
            traj.spans = 0
        if traj.first_root is None and traj.open is None:
            self._forget(traj)  # nothing recorded, no id given: nothing to join
            return
        self.written[traj] = None
        while len(self.written) > KEPT:
            self._forget(self.written.popitem(last=False)[0])

    def _forget(self, traj: ProxyTrajectory) -> None:
        self.open.discard(traj)
        self.written.pop(traj, None)
        self.index.remove(traj)
        if self.by_key.get(traj.key) is traj:
            del self.by_key[traj.key]
        if traj.id is not None and self.by_id.get(traj.id) is traj:
            del self.by_id[traj.id]

    def close_idle(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        idle = [t for t in self.open if not t.busy and now - t.last_used >= self.idle_s]
        for traj in idle:
            self.close(traj)
        return len(idle)

    def close_all(self, timeout: float | None = None) -> bool:
        """Write every open trajectory and hand on all that waits for the recorder (waiting for the
        disk as long as it takes, or ``timeout``); True when nothing was left waiting."""
        for traj in list(self.open):
            self.close(traj)
        return self.handoff.close(timeout) if self.handoff is not None else True

    def drop_if_empty(self, traj: ProxyTrajectory) -> None:
        """A new trajectory whose first call was never answered: gone without a trace."""
        if not traj.spans and not traj.busy and traj.first_root is None and not traj.closed:
            self._forget(traj)

    # -- signals --------------------------------------------------------------------------------------

    def signals(self, data: dict[str, Any]) -> str:
        """Record rewards/advantages (and an ``output``, such as the trainer's per-token
        ``old_log_probs``) posted for a trajectory (by ``trajectory_id`` or by its keys);
        writes it first when it is open. Returns its id; raises UnknownTrajectory when this proxy
        recorded no such trajectory (nothing is written then)."""
        names = {k: data[k] for k in FIELDS if k in data and k != "experiment"}
        trajectory_id = data.get("trajectory_id")
        key = TrajectoryKey.of(**names) if names else None
        if trajectory_id is not None:
            traj = self.by_id.get(str(trajectory_id))
            if traj is None:
                raise UnknownTrajectory(f"no recorded trajectory has the id {trajectory_id!r}")
            if key is not None and key != traj.key:
                raise ProxyError(f"trajectory {trajectory_id} has the keys {traj.key}, not {key}")
        elif key is not None:
            traj = self.by_key.get(key)
            if traj is None:
                raise UnknownTrajectory(f"no recorded trajectory has the keys {key}")
        else:
            raise ProxyError("signals name no trajectory")
        self.close(traj)
        if traj.first_root is None:
            raise UnknownTrajectory(f"no recorded trajectory has the id {traj.id} (it recorded no call)")
        values = {k: data.get(k) for k in ("reward", "advantage") if data.get(k) is not None}
        attributes = data.get("attributes") if isinstance(data.get("attributes"), dict) else None
        # e.g. the trainer's per-token log-probs: {"old_log_probs": [...]}, one per response token
        output = data.get("output") if isinstance(data.get("output"), dict) else None
        from rlreplay.recorder.api import get_recorder

        if self.handoff is None or get_recorder() is None:
            raise ProxyError("signals could not be recorded (is recording on?)")
        key = traj.key
        # on the hand-off thread, after the trajectory's root span: a copy of the output and a full
        # queue are that thread's to pay for (what cannot be recorded is counted there)
        self.handoff.call(
            functools.partial(
                record_signals,
                str(traj.id),
                step=key.step,
                sample_index=key.sample_index,
                rollout_n=key.rollout_n,
                validate=key.validate,
                attributes=attributes,
                output=output,
                root_span_id=traj.first_root,
                **values,
            )
        )
        return str(traj.id)


def replay_error(state: Any) -> BaseException | None:
    """A replayed trajectory that diverged: its root span's error (its status in ``ls``)."""
    if not state.diverged:
        return None
    return ReplayDivergence(f"replay diverged: {state.reason or 'a call the recording does not hold'}")
