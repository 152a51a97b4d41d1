"""rlreplay: record every RL rollout trajectory locally; browse, decode, diff and upload later.

Attributes load lazily so that importing ``rlreplay`` (as every recorded process does) costs
nothing until recording or reading actually starts.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__all__ = [
    "Run",
    "RunError",
    "Span",
    "Trajectory",
    "close",
    "disabled",
    "flush",
    "init",
    "open_run",
    "stats",
    "trace_op",
    "trajectory",
]

_LAZY = {
    "init": "rlreplay.recorder",
    "trace_op": "rlreplay.recorder",
    "trajectory": "rlreplay.recorder",
    "flush": "rlreplay.recorder",
    "close": "rlreplay.recorder",
    "disabled": "rlreplay.recorder",
    "stats": "rlreplay.recorder",
    "open_run": "rlreplay.store",
    "Run": "rlreplay.store",
    "RunError": "rlreplay.store",
    "Span": "rlreplay.store",
    "Trajectory": "rlreplay.store",
}

if TYPE_CHECKING:
    from rlreplay.recorder import close, disabled, flush, init, stats, trace_op, trajectory
    from rlreplay.store import Run, RunError, Span, Trajectory, open_run


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # submodules (rlreplay.conversation, rlreplay.token2text, ...) load on first use
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            value = importlib.import_module(f"{__name__}.{name}")
            globals()[name] = value
            return value
        raise AttributeError(f"module 'rlreplay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
