"""Which trajectory and step a proxied call belongs to, and recording them as an ordinary run.

A call names its trajectory in the ``X-Rlreplay-Trajectory`` header (or the OpenAI ``metadata``
key ``rlreplay_trajectory``): ``step=3,sample_index=12,rollout_n=0,validate=false``; every call
naming the same keys joins one trajectory. Otherwise a call whose prompt extends an open
trajectory's last prompt + answer (chat messages, completion text, token ids) continues it, and
any other call opens a new one (``step``: the proxy's step, ``sample_index``: a counter per step).
A trajectory is written when it has been idle for ``idle_s``, when signals are posted for it, and
when the proxy stops; a call the upstream never answered leaves no trajectory behind.

Steps advance on weight updates that pass through (consecutive updates with no generation between
them count once) or ``POST /rlreplay/step``. Spans go to the recorder through a hand-off
(``rlreplay.proxy.handoff``): the proxy's event loop never encodes spans or waits for the disk.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from rlreplay.errors import ProxyError
from rlreplay.format.keys import KEYS, TrajectoryKey, parse_bool, parse_int
from rlreplay.format.schema import KIND_LLM, KIND_TRAJECTORY
from rlreplay.proxy.handoff import Handoff
from rlreplay.proxy.protocol import CHAT, answer_of, prompt_of
from rlreplay.recorder import events
from rlreplay.recorder.events import OPEN, OPEN_BYTES, Control, OpenTrajectory, OpMeta, SpanEvent
from rlreplay.recorder.signals import record_signals

HEADER = "X-Rlreplay-Trajectory"
METADATA_KEY = "rlreplay_trajectory"
_KEY_NAMES = (*KEYS, "validate")


def parse_key(text: str) -> TrajectoryKey:
    """``step=3,sample_index=12,rollout_n=0,validate=false`` as a key (integers as integers, other
    values as strings); raises ProxyError naming what is wrong."""
    values: dict[str, Any] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in _KEY_NAMES:
            raise ProxyError(
                f"{HEADER}: {part.strip()!r} is not one of {', '.join(k + '=' for k in _KEY_NAMES)}"
            )
        if name == "validate":
            flag = parse_bool(value)
            if flag is None:
                raise ProxyError(f"{HEADER}: validate={value!r} is not true or false")
            values[name] = flag
        else:
            number = parse_int(value)
            values[name] = number if number is not None else value
    if not values:
        raise ProxyError(f"{HEADER}: no key given")
    return TrajectoryKey.of(**values)


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
                parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(parts)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def normal_message(message: Any) -> tuple:
    """A chat message as continuation compares it: role, text, tool calls (name, arguments as
    JSON), the tool call it answers; ids, refusals and other extras aside."""
    if not isinstance(message, dict):
        return ("?", _text(message), (), None)
    calls = []
    for call in message.get("tool_calls") or ():
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


def context_sequence(route: str, body: dict[str, Any], record: dict[str, Any]) -> tuple[str, Any] | None:
    """(kind, sequence) a later call's prompt starts with when it continues this call: the prompt
    and the first choice's answer."""
    prompt = prompt_sequence(route, body)
    if prompt is None:
        return None
    kind, sequence = prompt
    answer = answer_of(route, record)
    if kind == "chat":
        return (kind, (*sequence, normal_message(answer))) if isinstance(answer, dict) else None
    if not isinstance(answer, dict):
        return None
    if kind == "text" and isinstance(answer.get("text"), str):
        return kind, sequence + answer["text"]
    if kind == "ids" and isinstance(answer.get("ids"), list):
        return kind, (*sequence, *answer["ids"])
    return None


class ContinuationIndex:
    """Open trajectories by the prompt + answer a continuing call's prompt starts with. Several may
    share one (a group of rollouts of one prompt answered alike): a continuing call takes the one
    that has waited longest."""

    def __init__(self) -> None:
        self._by_length: dict[tuple[str, int], dict[Any, list[ProxyTrajectory]]] = {}

    def add(self, context: tuple[str, Any], traj: ProxyTrajectory) -> None:
        kind, sequence = context
        self._by_length.setdefault((kind, len(sequence)), {}).setdefault(sequence, []).append(traj)
        traj.context = context

    def remove(self, traj: ProxyTrajectory) -> None:
        if traj.context is None:
            return
        kind, sequence = traj.context
        traj.context = None
        bucket = self._by_length.get((kind, len(sequence)))
        waiting = bucket.get(sequence) if bucket is not None else None
        if not waiting:
            return
        with contextlib.suppress(ValueError):
            waiting.remove(traj)
        if not waiting:
            del bucket[sequence]
            if not bucket:
                del self._by_length[(kind, len(sequence))]

    def claim(self, prompt: tuple[str, Any]) -> ProxyTrajectory | None:
        """The open trajectory whose context ``prompt`` extends (the longest), taken out of the index."""
        kind, sequence = prompt
        lengths = sorted((n for k, n in self._by_length if k == kind and n < len(sequence)), reverse=True)
        for n in lengths:
            waiting = self._by_length[(kind, n)].get(sequence[:n])
            if waiting:
                traj = waiting[0]
                self.remove(traj)
                return traj
        return None


# ---- trajectories -----------------------------------------------------------------------------------


@dataclass(eq=False)
class ProxyTrajectory:
    """One trajectory of proxied calls; written (its root span) when closed."""

    key: TrajectoryKey
    explicit: bool
    replay: Any = None  # its replay state (rlreplay.recorder.replay.TrajectoryReplay)
    open: OpenTrajectory | None = None  # set by its first recorded span
    root_span: int = 0
    start_ns: int = 0
    last_used: float = field(default_factory=time.monotonic)
    spans: int = 0
    context: tuple[str, Any] | None = None
    busy: int = 0  # calls in flight

    @property
    def id(self) -> str | None:
        return events.format_trajectory_id(self.open.id) if self.open is not None else None

    @property
    def root_span_id(self) -> str | None:
        return events.format_span_id(self.root_span) if self.root_span else None


_ROOT_META = OpMeta(name="trajectory", kind=KIND_TRAJECTORY)
_DONE_KEPT = 100_000  # written trajectories remembered by key, for signals posted later


class Trajectories:
    """The proxy's open trajectories, its step, and the recorder they are written with."""

    def __init__(self, recorder: Any, idle_s: float = 300.0, experiment: str | None = None) -> None:
        self.recorder = recorder
        self.handoff = Handoff(recorder) if recorder is not None else None
        self.idle_s = idle_s
        self.experiment = experiment
        self.step = 0
        self._generated_since_update = False
        self._counters: dict[Any, itertools.count] = {}
        self._first_free: dict[Any, int] = {}
        self.by_key: dict[TrajectoryKey, ProxyTrajectory] = {}
        self.open: set[ProxyTrajectory] = set()
        self.index = ContinuationIndex()
        self.done: OrderedDict[TrajectoryKey, tuple[str, str | None]] = OrderedDict()
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
        if isinstance(sample_index, int):
            self._first_free[step] = max(self._first_free.get(step, 0), sample_index + 1)

    def new_key(self) -> TrajectoryKey:
        counter = self._counters.get(self.step)
        if counter is None:
            counter = self._counters[self.step] = itertools.count(self._first_free.get(self.step, 0))
        return TrajectoryKey.of(self.step, next(counter), None, False)

    # -- which trajectory ---------------------------------------------------------------------------

    def find(
        self, route: str, body: dict[str, Any], named: TrajectoryKey | None
    ) -> tuple[ProxyTrajectory, bool]:
        """The trajectory a call belongs to, and whether it is new (not yet started)."""
        self._generated_since_update = True
        if named is not None:
            traj = self.by_key.get(named)
            if traj is None:
                traj = self.by_key[named] = ProxyTrajectory(named, explicit=True)
                self.open.add(traj)
                return traj, True
            return traj, False
        prompt = prompt_sequence(route, body)
        traj = self.index.claim(prompt) if prompt is not None else None
        if traj is not None:
            return traj, False
        traj = ProxyTrajectory(TrajectoryKey(), explicit=False)
        self.open.add(traj)
        return traj, True

    def name(self, traj: ProxyTrajectory, key: TrajectoryKey | None = None) -> None:
        """Give a new unnamed trajectory its key (``key``: a replay's source key), else the next free one."""
        traj.key = key if key is not None else self.new_key()

    def continues(
        self, traj: ProxyTrajectory, route: str, body: dict[str, Any], record: dict[str, Any]
    ) -> None:
        """After a call answered: later calls extending its prompt + answer join ``traj``."""
        if traj.explicit or not isinstance(record, dict):
            return
        context = context_sequence(route, body, record)
        if context is not None and traj in self.open:
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
            key = traj.key
            traj.open = OpenTrajectory(replace(key, experiment=self.experiment))
            traj.root_span = next(events.span_ids)
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
            if not traj.spans:
                self.allocate(traj)
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
        """Write ``traj``'s root span (nothing when it recorded no call)."""
        self.open.discard(traj)
        self.index.remove(traj)
        if traj.explicit and self.by_key.get(traj.key) is traj:
            del self.by_key[traj.key]
        if not traj.spans or self.recorder is None or self.handoff is None:
            return
        if traj.replay is not None:
            traj.open.attributes = {**(traj.open.attributes or {}), **traj.replay.attributes()}
        end = time.time_ns()
        with contextlib.suppress(Exception):
            self.handoff.give(
                SpanEvent(
                    traj.open, traj.root_span, None, _ROOT_META, traj.start_ns, end, None, (), {}, None, 256
                )
            )
            self.recorder.wake()
        self.done[traj.key] = (traj.id or "", traj.root_span_id)
        self.done.move_to_end(traj.key)
        while len(self.done) > _DONE_KEPT:
            self.done.popitem(last=False)

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
        if not traj.spans and not traj.busy:
            self.open.discard(traj)
            self.index.remove(traj)
            if traj.explicit and self.by_key.get(traj.key) is traj:
                del self.by_key[traj.key]

    # -- signals --------------------------------------------------------------------------------------

    def signals(self, data: dict[str, Any]) -> str:
        """Record rewards/advantages (and an ``output``, such as the trainer's per-token
        ``old_log_probs``) posted for a trajectory (by ``trajectory_id`` or by its keys);
        closes it first when it is open. Returns its id; raises ProxyError when none matches."""
        names = {k: data[k] for k in _KEY_NAMES if k in data}
        trajectory_id = data.get("trajectory_id")
        key = TrajectoryKey.of(**names) if names else None
        root = None
        if key is not None and key in self.by_key:
            self.close(self.by_key[key])
        if trajectory_id is None:
            if key is None or key not in self.done:
                raise ProxyError(
                    f"no recorded trajectory has the keys {key}" if key else "signals name no trajectory"
                )
            trajectory_id, root = self.done[key]
        else:
            for t in list(self.open):
                if t.id == trajectory_id:
                    self.close(t)
            found = next(((k, v) for k, v in self.done.items() if v[0] == trajectory_id), None)
            if found is not None:
                key, (trajectory_id, root) = found
        key = key or TrajectoryKey()
        values = {k: data.get(k) for k in ("reward", "advantage") if data.get(k) is not None}
        attributes = data.get("attributes") if isinstance(data.get("attributes"), dict) else None
        # e.g. the trainer's per-token log-probs: {"old_log_probs": [...]}, one per response token
        output = data.get("output") if isinstance(data.get("output"), dict) else None
        from rlreplay.recorder.api import get_recorder

        if self.handoff is None or get_recorder() is None:
            raise ProxyError("signals could not be recorded (is recording on?)")
        # on the hand-off thread, after the trajectory's root span: a copy of the output and a full
        # queue are that thread's to pay for (what cannot be recorded is counted there)
        self.handoff.call(
            functools.partial(
                record_signals,
                str(trajectory_id),
                step=key.step,
                sample_index=key.sample_index,
                rollout_n=key.rollout_n,
                validate=key.validate,
                attributes=attributes,
                output=output,
                root_span_id=root,
                **values,
            )
        )
        return str(trajectory_id)
