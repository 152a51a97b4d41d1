"""Which framework adapter reads a run: the installed adapters by name, and the one a run names.

Adapters are plug-ins of the entry-point group ``rlreplay.adapters`` (rlreplay's own ``generic`` and
``verl`` are registered there too), so a new framework is one package declaring
``[project.entry-points."rlreplay.adapters"] myfw = "mypkg.adapter:MyAdapter"``. A run names its
framework in ``run.json`` (``"framework"``); runs without one are read with ``generic``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from rlreplay import plugins
from rlreplay.errors import RunError

if TYPE_CHECKING:
    from rlreplay.hookspecs import FrameworkAdapter
    from rlreplay.model import Trajectory
    from rlreplay.text.conversation import BatchDecoder

MANIFEST_KEY = "framework"
DEFAULT = "generic"

_lock = threading.Lock()
_loaded: dict[str, FrameworkAdapter] = {}


def available() -> list[str]:
    """Names of the installed adapters."""
    return sorted(plugins.specs("adapters"))


def _instantiate(obj: Any) -> FrameworkAdapter:
    adapter = obj() if isinstance(obj, type) else obj
    if not isinstance(getattr(adapter, "name", None), str):
        raise TypeError(f"{obj!r} is not a framework adapter (no name)")
    return adapter


def get_adapter(name: str | None = None) -> FrameworkAdapter:
    """The adapter registered under ``name`` (None: ``generic``); loaded once per process."""
    key = (name or DEFAULT).strip().lower()
    with _lock:
        hit = _loaded.get(key)
    if hit is not None:
        return hit
    found = plugins.specs("adapters")
    try:
        if key in found:
            adapter = _instantiate(plugins.load(found[key]))
        else:
            raise RunError(f"unknown framework {key!r}; installed adapters: {', '.join(available())}")
    except RunError:
        raise
    except Exception as exc:
        raise RunError(f"cannot load the {key!r} framework adapter: {type(exc).__name__}: {exc}") from None
    with _lock:
        return _loaded.setdefault(key, adapter)


def adapter_for_run(run: Any) -> FrameworkAdapter:
    """The adapter named by the run's manifest; ``generic`` when it names none or an uninstalled one."""
    manifest = getattr(run, "manifest", None) or {}
    name = manifest.get(MANIFEST_KEY)
    if not isinstance(name, str) or not name.strip():
        return get_adapter(DEFAULT)
    try:
        return get_adapter(name)
    except RunError as exc:
        warn = getattr(run, "warn", None)
        if callable(warn):
            warn(f"{exc}; reading with the generic adapter")
        return get_adapter(DEFAULT)


def openai_messages(
    traj: Trajectory, decoder: BatchDecoder | None = None, adapter: FrameworkAdapter | None = None
) -> list[dict[str, Any]]:
    """The trajectory's conversation in OpenAI chat format, as its adapter builds it (default: generic)."""
    if adapter is None:
        adapter = get_adapter()
    return adapter.messages(traj, decoder)
