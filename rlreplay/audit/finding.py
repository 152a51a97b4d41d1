"""An audit check's interface where the audit code imports it, and the thresholds a check reads.

``Check``, ``Finding`` and ``Context`` are declared with the other plug-in interfaces in
``rlreplay.hookspecs``; a check written for rlreplay imports them from here or from there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from rlreplay.errors import SelectionError
from rlreplay.format.keys import FIELDS, TrajectoryKey
from rlreplay.hookspecs import (  # noqa: F401 - the audit code and check plug-ins import them from here
    ERROR,
    LEVEL_GROUP,
    LEVEL_STEP,
    LEVEL_TRAJECTORY,
    OVER_LISTING,
    OVER_TRAJECTORIES,
    WARNING,
    Check,
    Context,
    Finding,
)


def finding_about(
    check: str, trajectory_id: str | None, key: TrajectoryKey, severity: str, detail: str, **kw: Any
) -> Finding:
    """A finding about the trajectory (or group, or steps) that ``key`` names."""
    keys = {f: getattr(key, f) for f in FIELDS if f != "experiment"}
    return Finding(check, trajectory_id, **keys, severity=severity, detail=detail, **kw)


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
            number = float(value)
        except ValueError:
            raise SelectionError(f"--threshold {item!r}: {value!r} is not a number") from None
        if not math.isfinite(number):
            raise SelectionError(f"--threshold {item!r}: give a finite number")
        out[key] = number
    return out
