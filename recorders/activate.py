"""Turn recording on in a process without touching the user's code.

``rlreplay record`` puts ``bootstrap/sitecustomize.py`` on ``PYTHONPATH``, which calls
:func:`activate` in every Python process of the job. It installs an import hook that patches
verl's tracing module the moment it is imported, and wraps ``ray.init`` so that every Ray
worker, on any node, runs :func:`worker_setup` through the job's ``runtime_env``.
Nothing heavy is imported here: processes that never import verl pay one dict lookup per import.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from rlreplay import plugins, settings

log = logging.getLogger("rlreplay")

BUILTIN_FRAMEWORKS = ("verl", "generic", "auto")  # hooked by HOOKS below, no entry-point lookup
SETUP_HOOK = "rlreplay.recorders.activate.worker_setup"
VERL_TRACE_MODULE = "verl.utils.rollout_trace"

_activated = False


def _hook(spec: str) -> Callable[[ModuleType], None]:
    """The hook named ``"module:function"``, imported when its watched module is."""

    def call(module: ModuleType) -> None:
        plugins.load(spec)(module)

    return call


def _on_ray(module: ModuleType) -> None:
    init = getattr(module, "init", None)
    if init is None or getattr(init, "__rlreplay_wrapped__", False):
        return

    def rlreplay_ray_init(*args: Any, **kwargs: Any) -> Any:
        try:
            kwargs["runtime_env"] = job_runtime_env(kwargs.get("runtime_env"))
        except Exception as exc:  # never break the user's ray.init
            log.warning("rlreplay: could not extend ray's runtime_env: %s", exc)
        global _closed_cluster
        context = init(*args, **kwargs)
        _closed_cluster = False  # this session's recorders are asked to close at its shutdown
        _close_writers_at_shutdown(module)
        return context

    rlreplay_ray_init.__wrapped__ = init  # type: ignore[attr-defined]
    rlreplay_ray_init.__rlreplay_wrapped__ = True  # type: ignore[attr-defined]
    rlreplay_ray_init.__doc__ = init.__doc__
    module.init = rlreplay_ray_init  # type: ignore[attr-defined]


_shutdown_hooked = False
CLOSE_WAIT_S = 30.0


def _close_writers_at_shutdown(ray: ModuleType) -> None:
    """In the driver: before Ray ends the job (whose actors are killed without closing), ask the
    recording processes on every node to seal and upload their files."""
    global _shutdown_hooked
    if _shutdown_hooked or not settings.DIR.get():
        return
    _shutdown_hooked = True
    shutdown = ray.shutdown

    def rlreplay_ray_shutdown(*args: Any, **kwargs: Any) -> Any:
        close_cluster_writers()
        return shutdown(*args, **kwargs)

    rlreplay_ray_shutdown.__wrapped__ = shutdown  # type: ignore[attr-defined]
    ray.shutdown = rlreplay_ray_shutdown  # type: ignore[attr-defined]
    atexit.register(close_cluster_writers)  # after Ray's own exit hook was registered: runs before it


_closed_cluster = False


def close_cluster_writers(wait_s: float = CLOSE_WAIT_S) -> int:
    """Run :func:`rlreplay.remote.publish.close_node_writers` on every live node of the cluster."""
    global _closed_cluster
    ray = sys.modules.get("ray")
    target = settings.DIR.get()
    if _closed_cluster or ray is None or not target or not ray.is_initialized():
        return 0
    _closed_cluster = True
    try:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(_close_node_writers)
        refs = [
            task.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ).remote(target, settings.SPOOL.get(), wait_s, os.getpid())
            for node in ray.nodes()
            if node.get("Alive")
        ]
        return sum(ray.get(refs, timeout=wait_s + 30))
    except Exception as exc:
        log.warning("rlreplay: could not ask the cluster's recorders to close: %s", exc)
        return 0


def _close_node_writers(target: str, spool: str | None, wait_s: float, exclude_pid: int) -> int:
    from rlreplay.remote.publish import close_node_writers

    return close_node_writers(target, spool, wait_s, exclude_pid)


HOOKS: dict[str, Callable[[ModuleType], None]] = {
    VERL_TRACE_MODULE: _hook("rlreplay.recorders.verl:install"),
    "verl.experimental.agent_loop.agent_loop": _hook("rlreplay.recorders.verl:install_agent_loop"),
    "verl.trainer.ppo.ray_trainer": _hook("rlreplay.recorders.verl_trainer:install"),
    "ray": _on_ray,
}


def recording_env() -> dict[str, str]:
    chained = settings.CHAINED_SETUP_HOOK.name
    return {k: v for k, v in os.environ.items() if k.startswith(settings.PREFIX) and k != chained}


def job_runtime_env(runtime_env: Any) -> Any:
    """The user's runtime_env plus rlreplay's setup hook and env vars (user values win)."""
    env = dict(runtime_env or {}) if not hasattr(runtime_env, "to_dict") else runtime_env.to_dict()
    env_vars = {**recording_env(), **dict(env.get("env_vars") or {})}
    existing = env.get("worker_process_setup_hook")
    if existing and existing != SETUP_HOOK:
        if not isinstance(existing, str):
            return runtime_env  # a callable hook cannot be chained by name; keep the user's
        env_vars[settings.CHAINED_SETUP_HOOK.name] = existing
    env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        try:
            self._callback(module)
        except Exception as exc:
            log.warning("rlreplay: could not hook %s: %s", module.__name__, exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class ImportHook(importlib.abc.MetaPathFinder):
    """Calls a callback right after one of the watched modules is executed."""

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.hooks = hooks
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        callback = self.hooks.get(fullname)
        if callback is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, callback)
        return spec


def activate() -> None:
    """Install the import hooks (idempotent); patch watched modules already imported."""
    global _activated
    if _activated or settings.DISABLE.get_or_default():
        return
    _activated = True
    sys.meta_path.insert(0, ImportHook(HOOKS))
    _set_ray_worker_name()
    for name, callback in HOOKS.items():
        module = sys.modules.get(name)
        if module is not None:
            try:
                callback(module)
            except Exception as exc:
                log.warning("rlreplay: could not hook %s: %s", name, exc)
    if settings.REPLAY_SOURCE.get():
        try:
            from rlreplay.playback import start_from_env

            start_from_env()
        except Exception as exc:
            log.warning("rlreplay: replay not started in pid %s: %s", os.getpid(), exc)
    framework = (settings.FRAMEWORK.get() or "").strip().lower()
    if framework and framework not in BUILTIN_FRAMEWORKS:
        try:
            from rlreplay.adapters.registry import get_adapter

            get_adapter(framework).install()
        except Exception as exc:
            log.warning("rlreplay: could not install the %s adapter: %s", framework, exc)


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: runs in every worker before its tasks and actors."""
    activate()
    chained = settings.CHAINED_SETUP_HOOK.get()
    if chained:
        module_name, _, func = chained.rpartition(".")
        getattr(importlib.import_module(module_name), func)()


def _set_ray_worker_name() -> None:
    from rlreplay.recorder.workers import set_worker_resolver

    set_worker_resolver(ray_worker_name)


def ray_worker_name() -> str | None:
    """``<actor name or class>-<actor id prefix>`` inside a Ray actor, else None (host-pid)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        ctx = ray.get_runtime_context()
        actor_id = ctx.get_actor_id()
        if actor_id is None:
            return None
        name = ctx.get_actor_name() if hasattr(ctx, "get_actor_name") else None
        if name:
            return name
        label = "actor"
        with contextlib.suppress(Exception):
            label = ctx.current_actor._ray_actor_creation_function_descriptor.class_name
        return f"{label}-{actor_id[:8]}"
    except Exception:
        return None
