"""What counts as a tool error: the one definition the listing, ``show``, ``stats``, the UI and
``audit`` share.

A tool call failed when it raised (its span's status is ``error``), or when what it returned says
so: a mapping with a true ``error`` or with ``ok``/``success`` false (at the top, or as an item
of a returned tuple, such as verl's ``(ToolResponse, reward, metrics)``), or a response text that
begins with ``error``, ``exception`` or ``traceback``. The recorder writes the reason into the
span's ``error`` column as the call ends (its status stays ``ok``: the call returned); readers
judge the output of tool spans recorded before that, by this same rule.

Reads the JSON form of outputs (``rlreplay.format.payload``: an op's own dict with a ``__type__``
key is unwrapped first). Imports nothing heavy: recording processes use it.
"""

from __future__ import annotations

import re
from typing import Any

from rlreplay.format.payload import MARKER, unwrapped

#: A response text that says the call failed.
ERROR_TEXT = re.compile(r"\s*(error|exception|traceback)\b", re.I)
#: The longest reason kept (the span's ``error`` column).
REASON_CHARS = 500
#: Mapping keys that say the call went well (false: it failed).
_OK_KEYS = ("ok", "success")


def output_text(output: Any) -> str | None:
    """The text a tool call returned: a string, the ``text`` (or ``content``) of a response
    mapping, or of the first item of a returned tuple (verl's ``ToolResponse``)."""
    value = unwrapped(output)
    if isinstance(value, (list, tuple)) and value:
        value = unwrapped(value[0])
    if isinstance(value, dict):
        value = value.get("text", value.get("content"))
    return value if isinstance(value, str) else None


def _parts(output: Any) -> list[dict]:
    """The mappings a tool's result is made of: itself, or the items of a returned tuple."""
    output = unwrapped(output)
    if isinstance(output, dict):
        return [output]
    if isinstance(output, (list, tuple)) and len(output) <= 8:
        return [part for part in map(unwrapped, output) if isinstance(part, dict)]
    return []


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


def returned_error(output: Any) -> str | None:
    """Why a tool call's returned value says it failed (see the module docstring), or None."""
    output = unwrapped(output)  # the op's own dict that has a ``__type__`` key
    if isinstance(output, dict) and output.get(MARKER) is not None:
        return None  # a payload marker (a value recorded in its place), not the tool's result
    text = output_text(output)
    for part in _parts(output):
        error = part.get("error")
        if error and error is not True:
            return _short(str(error))
        if error is True or any(part.get(key) is False for key in _OK_KEYS):
            return _short(text) if text and text.strip() else "the result says it failed"
    if text is not None and ERROR_TEXT.match(text):
        return _short(text)
    return None


def tool_error(status: str | None, error: str | None, output: Any) -> str | None:
    """What went wrong in a tool call (its span's ``status``, ``error`` and decoded ``output``):
    the exception it raised, the reason recorded when it returned a failure, or what its output
    says (a span recorded before reasons were); None when nothing did."""
    if status == "error":
        return error or "raised"
    if error:
        return error
    return returned_error(output)
