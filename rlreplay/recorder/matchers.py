"""Which recorded op a call is served from: plain calls, recorded ops and the small matchers between them.

A replay serves a call (its kind, name and inputs, as JSON values) from the recorded op of its
trajectory that every matcher of ``match_on`` accepts. A matcher is a function
``(recorded_op, call) -> None | reason``: None when they match, else a one-line reason, which the
replay keeps (on the diverged span, the trajectory's root, ``ls --json``). The built-in matchers
are named in :data:`MATCHERS`; the default ``match_on`` is :data:`DEFAULT_MATCH_ON`.

Inputs are matched as the cassette prepares them: JSON values without the keys the framework
adapter names volatile (per-call ids such as ``request_id``, fresh on every run), at any depth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rlreplay.format.payload import same

#: Types of JSON scalars: a list of only these (token ids, log-probs) is kept as it is.
JSON_SCALARS = frozenset({int, float, str, bool, type(None)})


@dataclass
class RecordedOp:
    """One recorded call of a served kind: its position among its trajectory's calls of that kind."""

    span_id: str
    name: str
    inputs: Any  # JSON value; the cassette drops the volatile keys before the first match
    output: Any  # JSON form (``rlreplay.format.payload``)
    position: int = 0
    #: the output's type record (``rlreplay.format.payload.from_json``); None: recorded without one
    output_type: dict[str, str] | None = None


@dataclass(frozen=True)
class Call:
    """A call to serve: the ``position``-th (from 0) call of its kind in its trajectory."""

    kind: str
    name: str
    inputs: Any
    position: int


Matcher = Callable[[RecordedOp, Call], "str | None"]


def position(op: RecordedOp, call: Call) -> str | None:
    """The k-th call of a kind is served from the k-th recorded op of that kind."""
    if op.position == call.position:
        return None
    return f"{call.name} call {call.position + 1} of kind {call.kind!r} is recorded as call {op.position + 1}"


def name(op: RecordedOp, call: Call) -> str | None:
    """The same op (its recorded name)."""
    if op.name == call.name:
        return None
    return f"{call.kind} call {call.position + 1} is {call.name}, recorded {op.name}"


def inputs(op: RecordedOp, call: Call) -> str | None:
    """The same inputs, volatile keys aside, bit for bit (``-0.0`` is not ``0.0``; ``1``, ``1.0``
    and ``true`` differ)."""
    if same(op.inputs, call.inputs):
        return None
    where = first_path(op.inputs, call.inputs)
    return f"{call.name} call {call.position + 1} has other inputs than recorded span {op.span_id}" + (
        f" (first at {where})" if where else ""
    )


#: The matchers ``match_on`` may name.
MATCHERS: dict[str, Matcher] = {"position": position, "name": name, "inputs": inputs}
DEFAULT_MATCH_ON = ("position", "name", "inputs")


def matchers(match_on: Iterable[str | Matcher]) -> tuple[Matcher, ...]:
    """Matchers by name (or given as functions); raises ValueError naming an unknown one."""
    out = []
    for m in match_on:
        if callable(m):
            out.append(m)
        elif m in MATCHERS:
            out.append(MATCHERS[m])
        else:
            raise ValueError(f"unknown matcher {m!r} (matchers: {', '.join(MATCHERS)})")
    if not out:
        raise ValueError(f"no matcher given (matchers: {', '.join(MATCHERS)})")
    return tuple(out)


def mismatch(op: RecordedOp, call: Call, used: tuple[Matcher, ...]) -> str | None:
    """The first reason a matcher gives why ``call`` is not ``op``'s; None when all accept it.
    A matcher that raises does not match, and says so."""
    for matcher in used:
        try:
            reason = matcher(op, call)
        except Exception as exc:
            return f"matcher {getattr(matcher, '__name__', matcher)!r} failed: {type(exc).__name__}: {exc}"
        if reason is not None:
            return str(reason)
    return None


def comparable(value: Any, ignored: frozenset[str] = frozenset()) -> Any:
    """``value`` without the ``ignored`` keys (at any depth); tuples as lists, as JSON has them."""
    if isinstance(value, dict):
        return {k: comparable(v, ignored) for k, v in value.items() if k not in ignored}
    if isinstance(value, (list, tuple)):
        if JSON_SCALARS.issuperset(map(type, value)):  # token ids, log-probs: as they are
            return list(value)
        return [comparable(v, ignored) for v in value]
    return value


class _Absent:
    """What one side holds at a path that only the other side has."""

    def __repr__(self) -> str:
        return "ABSENT"


#: The value :func:`first_values` gives for a side that has nothing at the path.
ABSENT: Any = _Absent()


def first_values(a: Any, b: Any, at: str = "") -> tuple[str, Any, Any]:
    """Where two JSON values first differ, as a path like ``kwargs.prompt_ids[3]``, and what each
    holds there (:data:`ABSENT` for a side that has nothing at that path)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b or not same(a[key], b[key]):
                inner = f"{at}.{key}" if at else str(key)
                if key in a and key in b:
                    return first_values(a[key], b[key], inner)
                return inner, a.get(key, ABSENT), b.get(key, ABSENT)
        return at, a, b
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if not same(x, y):
                return first_values(x, y, f"{at}[{i}]")
        n = min(len(a), len(b))
        return f"{at}[{n}]", a[n] if n < len(a) else ABSENT, b[n] if n < len(b) else ABSENT
    return at, a, b


def first_path(a: Any, b: Any, at: str = "") -> str:
    """Where two JSON values first differ, as a path like ``kwargs.prompt_ids[3]``."""
    return first_values(a, b, at)[0]
