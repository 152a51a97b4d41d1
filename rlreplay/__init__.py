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
    "replay",
    "stats",
    "trace_op",
    "trajectory",
]

_LAZY = {
    "init": "rlreplay.recorder.api",
    "trace_op": "rlreplay.recorder.api",
    "trajectory": "rlreplay.recorder.api",
    "flush": "rlreplay.recorder.api",
    "close": "rlreplay.recorder.api",
    "disabled": "rlreplay.recorder.api",
    "stats": "rlreplay.recorder.api",
    "open_run": "rlreplay.read.open",
    "replay": "rlreplay.playback",
    "Run": "rlreplay.read.run",
    "RunError": "rlreplay.errors",
    "Span": "rlreplay.model",
    "Trajectory": "rlreplay.model",
}

if TYPE_CHECKING:
    from rlreplay.errors import RunError
    from rlreplay.model import Span, Trajectory
    from rlreplay.playback import replay
    from rlreplay.read.open import open_run
    from rlreplay.read.run import Run
    from rlreplay.recorder.api import close, disabled, flush, init, stats, trace_op, trajectory


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # submodules (rlreplay.text.conversation, rlreplay.text.token2text, ...) load on first use
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            value = importlib.import_module(f"{__name__}.{name}")
            globals()[name] = value
            return value
        raise AttributeError(f"module 'rlreplay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
