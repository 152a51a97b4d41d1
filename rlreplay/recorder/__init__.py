"""Recording: the public API (init, trace_op, trajectory, record_signals), the writer thread, span rows.

The calling thread only takes ids, two clock reads, a contextvar lookup, a copy of mutable
token lists and a deque append. Binding arguments, encoding payloads, building Arrow batches,
compression, I/O and fsync happen on the writer thread. Nothing here raises into the caller.
Names load on first use: ``record_signals`` costs nothing until recording is on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "ENV_DIR": "api",
    "ENV_DISABLE": "api",
    "ENV_EXPERIMENT": "api",
    "close": "api",
    "disabled": "api",
    "flush": "api",
    "get_recorder": "api",
    "init": "api",
    "stats": "api",
    "trace_op": "api",
    "trajectory": "api",
    "OpMeta": "events",
    "format_span_id": "events",
    "format_trajectory_id": "events",
    "record_signals": "signals",
    "set_worker_resolver": "workers",
}
__all__ = [
    "ENV_DIR",
    "ENV_DISABLE",
    "ENV_EXPERIMENT",
    "OpMeta",
    "close",
    "disabled",
    "flush",
    "format_span_id",
    "format_trajectory_id",
    "get_recorder",
    "init",
    "record_signals",
    "set_worker_resolver",
    "stats",
    "trace_op",
    "trajectory",
]

if TYPE_CHECKING:
    from rlreplay.recorder.api import (
        ENV_DIR,
        ENV_DISABLE,
        ENV_EXPERIMENT,
        close,
        disabled,
        flush,
        get_recorder,
        init,
        stats,
        trace_op,
        trajectory,
    )
    from rlreplay.recorder.events import OpMeta, format_span_id, format_trajectory_id
    from rlreplay.recorder.signals import record_signals
    from rlreplay.recorder.workers import set_worker_resolver


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rlreplay.recorder' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
