"""One plug-in loader: adapters, uploaders and audit checks, found by entry point (built-ins too).

A plug-in is a ``"module:attribute"`` spec registered under a name in its kind's entry-point group
(``rlreplay.hookspecs`` declares the groups and what each kind of plug-in implements), the way
rlreplay's own adapters, uploaders and checks are (``pyproject.toml``: the one list of built-ins,
read from the installed metadata, an editable install's too). Specs registered
in-process (:func:`register`) come last and win. Nothing is imported until :func:`load`.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from rlreplay.hookspecs import GROUPS

#: Specs registered in this process, per kind (``name -> "module:attribute"``).
REGISTERED: dict[str, dict[str, str]] = {kind: {} for kind in GROUPS}


def register(kind: str, name: str, spec: str) -> None:
    """Register ``spec`` (``"module:attribute"``) as plug-in ``name`` of ``kind`` in this process."""
    REGISTERED[kind][name] = spec


def specs(kind: str) -> dict[str, str]:
    """Every plug-in of ``kind`` installed: ``name -> "module:attribute"``."""
    found: dict[str, str] = {}
    for group in GROUPS[kind]:
        found.update({ep.name: ep.value for ep in entry_points(group=group)})
    found.update(REGISTERED[kind])
    return found


def load(spec: str) -> Any:
    """Import a ``"module:attribute"`` spec. ImportError (a missing package) passes through."""
    module_name, _, attribute = spec.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attribute) if attribute else module
    except AttributeError:
        raise ImportError(f"{module_name} has no {attribute}", name=module_name) from None
