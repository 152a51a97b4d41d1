"""What crosses from the calling thread to the writer: span events, op metadata, ids."""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from rlreplay.format.keys import TrajectoryKey
from rlreplay.format.schema import KIND_OP

F = TypeVar("F", bound=Callable[..., Any])


_MASK128 = (1 << 128) - 1
_MASK64 = (1 << 64) - 1
_MIX128 = 0x9E3779B97F4A7C15F39CC0605CEDC835  # odd: multiplying is a bijection mod 2**128
_MIX64 = 0x9E3779B97F4A7C15


def _id_source() -> tuple[itertools.count, itertools.count, int]:
    return itertools.count(1), itertools.count(1), random.SystemRandom().getrandbits(128)


trajectory_ids, span_ids, id_salt = _id_source()


def reset_ids() -> None:
    """New counters and salt: a forked child must not repeat its parent's ids."""
    global trajectory_ids, span_ids, id_salt
    trajectory_ids, span_ids, id_salt = _id_source()


NO_KEY = TrajectoryKey()


class OpenTrajectory:
    """A trajectory being recorded: its id, its key, its attributes.

    ``step`` is the partition its spans are written to (an int step, else none); ``validate`` is the
    key's, or None where it is not known (signals for a trajectory recorded elsewhere); ``given``
    holds the key values as the caller gave them when one was neither an int nor a string (the
    writer says how it stored them); ``columns`` is the writer's: the key's stored columns, made once.
    """

    __slots__ = ("attributes", "columns", "explicit", "given", "id", "key", "replay", "step", "validate")

    def __init__(
        self,
        key: TrajectoryKey = NO_KEY,
        attributes: dict[str, Any] | None = None,
        explicit: bool = True,
        given: tuple[Any, Any, Any] | None = None,
    ) -> None:
        self.id: int | str = next(trajectory_ids)
        self.key = key
        self.step = key.step if type(key.step) is int else None
        self.validate: bool | None = key.validate
        self.given = given
        self.attributes = attributes
        self.explicit = explicit
        self.columns: Any = None
        self.replay: Any = None  # its replay state (rlreplay.recorder.replay), when a replay is on


def given_keys(*values: Any) -> tuple[Any, ...] | None:
    """Key values as a caller gave them, kept only when one is neither an int nor a string (numpy
    ints, floats, objects): the writer then says how it stored them."""
    return values if any(type(v) not in _PLAIN_KEYS for v in values) else None


_PLAIN_KEYS = (int, str, type(None))  # key values stored as given


def format_trajectory_id(n: int) -> str:
    """32 hex digits, unique per process counter, with well-spread prefixes (like git ids)."""
    return f"{((n * _MIX128) & _MASK128) ^ id_salt:032x}"


def format_span_id(n: int) -> str:
    return f"{((n * _MIX64) & _MASK64) ^ (id_salt & _MASK64):016x}"


@dataclass
class OpMeta:
    """What the writer needs to turn a call into a span; one per decorated function."""

    name: str
    kind: str = KIND_OP
    fn: Callable[..., Any] | None = None
    reduce_inputs: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    reduce_output: Callable[[Any], Any] | None = None
    reward: Callable[[Any], float | None] | None = None
    attributes: dict[str, Any] | None = None  # written on each of its spans (a served span's mark)
    _signature: inspect.Signature | None = field(default=None, repr=False)
    _skip_first: bool = False
    # (names in order, how many may be positional, defaults, names as a set): the usual signature,
    # bound without inspect (~5x faster); None for *args, **kwargs or positional-only parameters
    _plan: tuple[tuple[str, ...], int, dict[str, Any], frozenset[str]] | None = field(
        default=None, repr=False
    )

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Inputs as verl records them: bound arguments minus ``self``, ``**kwargs`` nested."""
        if self.fn is None:
            return {"args": list(args), **kwargs} if args else dict(kwargs)
        if self._signature is None:
            try:
                self._signature = inspect.signature(self.fn)
            except (TypeError, ValueError):
                self.fn = None
                return self.bind(args, kwargs)
            params = list(self._signature.parameters)
            self._skip_first = bool(params) and params[0] in ("self", "cls")
            self._plan = _bind_plan(self._signature)
        inputs = _fast_bind(self._plan, args, kwargs) if self._plan is not None else None
        if inputs is None:
            try:
                bound = self._signature.bind(*args, **kwargs)
            except TypeError:
                return {"args": list(args), **kwargs}
            bound.apply_defaults()  # as verl records them
            inputs = dict(bound.arguments)
        if self._skip_first and inputs:
            inputs.pop(next(iter(inputs)))
        return inputs


def _bind_plan(
    signature: inspect.Signature,
) -> tuple[tuple[str, ...], int, dict[str, Any], frozenset[str]] | None:
    kinds = [p.kind for p in signature.parameters.values()]
    if any(k not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) for k in kinds):
        return None
    names = tuple(signature.parameters)
    defaults = {
        n: p.default for n, p in signature.parameters.items() if p.default is not inspect.Parameter.empty
    }
    return names, kinds.count(inspect.Parameter.POSITIONAL_OR_KEYWORD), defaults, frozenset(names)


def _fast_bind(plan: tuple, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """What ``signature.bind`` + ``apply_defaults`` give, or None where inspect must decide (an
    unknown, missing or twice-given argument: it raises, and the call is recorded as given)."""
    names, positional, defaults, known = plan
    if len(args) > positional or (kwargs and not known.issuperset(kwargs)):
        return None
    inputs = {}
    n = len(args)
    for i, name in enumerate(names):
        if i < n:
            if name in kwargs:
                return None
            inputs[name] = args[i]
        elif name in kwargs:
            inputs[name] = kwargs[name]
        elif name in defaults:
            inputs[name] = defaults[name]
        else:
            return None
    return inputs


# ---- queue events -------------------------------------------------------------------------------

# What crosses from the calling threads to the writer, by kind. Each event has a ``kind`` and
# ``nbytes``, its estimated size (what it keeps alive while queued).
SPAN = 0  # a finished call (SpanEvent)
OPEN = 1  # an explicit trajectory started (Control: subject = the OpenTrajectory)
FLUSH = 2  # write and fsync what came before (Control: subject = a threading.Event to set, or None)
CLOSE = 3  # the root span of a trajectory was dropped (queue full) (Control: subject = the OpenTrajectory)
# write what came before into the live files, without fsync: the OS holds it, and a killed process
# loses none of it (Control: subject = a threading.Event to set, or None)
WRITE = 4
OPEN_BYTES = 64


# What a queued span keeps alive per item of a list it holds: the copy's 8-byte pointer and the item
# itself (an int id is a 28-byte object in a 32-byte slot; the caller may have dropped its own list).
_ITEM_BYTES = 40
_NO_FIELDS = frozenset((int, float, str, bool, bytes, tuple))  # results without a __dict__ to look into


def payload_bytes(args: tuple, kwargs: dict, result: Any) -> int:
    """A cheap estimate of the memory a queued span holds: its top-level lists, and the lists directly
    inside a dict or object result (``{"token_ids": [...]}``, a pydantic output)."""
    size = 256
    for value in args:
        if type(value) is list:
            size += len(value) * _ITEM_BYTES
    if kwargs:
        for value in kwargs.values():
            if type(value) is list:
                size += len(value) * _ITEM_BYTES
    cls = type(result)
    if cls is list:
        size += len(result) * _ITEM_BYTES
        return size
    if cls is dict:
        fields = result
    elif result is None or cls in _NO_FIELDS:
        return size
    else:
        try:
            fields = getattr(result, "__dict__", None)
        except Exception:
            fields = None
    if type(fields) is dict and len(fields) < 64:
        for value in list(fields.values()):  # a copy: another thread may change an object's fields
            if type(value) is list:
                size += len(value) * _ITEM_BYTES
    return size


@dataclass(slots=True)
class Control:
    """A queue event that is not a span: its kind (OPEN, FLUSH, WRITE, CLOSE) and what it is about."""

    kind: int
    subject: Any
    nbytes: int = 0


@dataclass(slots=True)
class SpanEvent:
    """A finished call, as the writer takes it: the one declaration of a span event's fields.

    Made on the calling thread for every traced call, so it is a slotted class without checks (a
    named tuple costs about twice as much to make); the writer turns it into a row (``rows.encode_row``).
    """

    traj: Any  # the OpenTrajectory (or a signals span's view of a recorded one)
    span_id: int | str  # a process counter (formatted by format_span_id) or a recorded id
    parent_id: int | str | None  # None: the trajectory's root span
    meta: OpMeta
    start_ns: int
    end_ns: int
    exc: BaseException | None
    args: tuple
    kwargs: dict[str, Any]
    result: Any
    nbytes: int  # what the queued event keeps alive (payload_bytes)
    kind: ClassVar[int] = SPAN
