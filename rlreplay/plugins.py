"""One plug-in loader: adapters, uploaders and audit checks, found by entry point (built-ins too).

A plug-in is a ``"module:attribute"`` spec registered under a name in its kind's entry-point group
(``rlreplay.hookspecs`` declares the groups and what each kind of plug-in implements), the way
rlreplay's own adapters, uploaders and checks are (see ``pyproject.toml``). Specs registered
in-process (:func:`register`) come last and win. Nothing is imported until :func:`load`.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from rlreplay.hookspecs import GROUPS

#: Built-ins, used when the installed metadata lacks their entry points (e.g. an old editable install).
BUILTINS: dict[str, dict[str, str]] = {
    "adapters": {
        "generic": "rlreplay.adapters.generic:GenericAdapter",
        "verl": "rlreplay.recorders.verl:VerlAdapter",
    },
    "uploaders": {
        "mlflow": "rlreplay.uploaders.mlflow:MlflowUploader",
        "weave": "rlreplay.uploaders.weave:WeaveUploader",
        "otlp": "rlreplay.uploaders.otlp:OtlpUploader",
        "trackio": "rlreplay.uploaders.trackio:TrackioUploader",
    },
    "checks": {
        "group_collapse": "rlreplay.audit.listing:GROUP_COLLAPSE",
        "mismatch": "rlreplay.audit.listing:MISMATCH",
        "length_drift": "rlreplay.audit.listing:LENGTH_DRIFT",
        "reward_drift": "rlreplay.audit.listing:REWARD_DRIFT",
        "retokenization": "rlreplay.audit.calls:RETOKENIZATION",
        "repetition": "rlreplay.audit.calls:REPETITION",
        "garbled": "rlreplay.audit.calls:GARBLED",
        "truncated": "rlreplay.audit.calls:TRUNCATED",
        "empty_response": "rlreplay.audit.calls:EMPTY_RESPONSE",
        "tool_error": "rlreplay.audit.calls:TOOL_ERROR",
        "parse_error": "rlreplay.audit.calls:PARSE_ERROR",
    },
}

#: Specs registered in this process, per kind (``name -> "module:attribute"``).
REGISTERED: dict[str, dict[str, str]] = {kind: {} for kind in GROUPS}


def register(kind: str, name: str, spec: str) -> None:
    """Register ``spec`` (``"module:attribute"``) as plug-in ``name`` of ``kind`` in this process."""
    REGISTERED[kind][name] = spec


def specs(kind: str) -> dict[str, str]:
    """Every plug-in of ``kind`` installed: ``name -> "module:attribute"``."""
    found = dict(BUILTINS.get(kind, {}))
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
