"""Naming the recording process (a Ray actor, a host-pid pair); imports nothing heavy."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable

from rlreplay import settings

_resolver: Callable[[], str | None] | None = None


def set_worker_resolver(resolver: Callable[[], str | None] | None) -> None:
    """Name this process's worker lazily (e.g. from the Ray actor); called once, on the writer thread."""
    global _resolver
    _resolver = resolver


def resolve_worker_name() -> str:
    """``$RLREPLAY_WORKER``, else the registered resolver's answer, else ``<host>-<pid>``."""
    name = settings.WORKER.get()
    if not name and _resolver is not None:
        with contextlib.suppress(Exception):
            name = _resolver()
    return name or f"{socket.gethostname()}-{os.getpid()}"
