"""What an audit check reports (``Finding``), what a check is (``Check``), and the thresholds it reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from rlreplay.errors import SelectionError

#: What a check reads: the listing (the run index, one row per trajectory) or each trajectory's spans.
OVER_LISTING, OVER_TRAJECTORIES = "listing", "trajectories"
#: What one finding is about.
LEVEL_TRAJECTORY, LEVEL_GROUP, LEVEL_STEP = "trajectory", "group", "step"
ERROR, WARNING = "error", "warning"


@dataclass
class Finding:
    """One problem found: a trajectory (``trajectory_id`` set), a group or a step range (null id)."""

    check: str
    trajectory_id: str | None
    step: Any
    sample_index: Any
    rollout_n: Any
    validate: bool | None
    severity: str
    detail: str
    turn: int | None = None
    position: int | None = None
    #: how bad, to order examples (larger is worse); not part of the record
    score: float = field(default=0.0, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("score")
        return out


@dataclass(frozen=True)
class Check:
    """A check: ``run(listing, context)`` over the listing, or ``run(trajectory, context)`` over
    each trajectory; either yields ``Finding``s. ``help`` says what it flags (``audit --help``)."""

    name: str
    over: str
    level: str
    help: str
    run: Callable[..., Iterable[Finding]]
    #: the thresholds it reads, with their defaults
    thresholds: dict[str, float] = field(default_factory=dict)
    #: needs a tokenizer to decode text (skipped with a note without one)
    needs_tokenizer: bool = False
    #: a trajectory check that reads only spans of these kinds: it may be given trajectories
    #: holding only those spans, without children or attributes, their token ids lists or numpy
    #: arrays (None: whole trajectories)
    span_kinds: tuple[str, ...] | None = None


@dataclass
class Context:
    """What a check gets besides its data: thresholds, the run's framework adapter, a decoder, and
    the run (a listing check that reads a few flagged trajectories' spans)."""

    thresholds: dict[str, float]
    adapter: Any = None
    decoder: Any = None
    run: Any = None

    def __getitem__(self, key: str) -> float:
        return self.thresholds[key]


def parse_thresholds(items: Iterable[str], known: dict[str, float]) -> dict[str, float]:
    """``KEY=VALUE`` overrides of the known thresholds (a bad key or number: SelectionError)."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known:
            names = ", ".join(sorted(known))
            raise SelectionError(f"--threshold {item!r}: expected KEY=VALUE with KEY one of {names}")
        try:
            out[key] = float(value)
        except ValueError:
            raise SelectionError(f"--threshold {item!r}: {value!r} is not a number") from None
    return out
