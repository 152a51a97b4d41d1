"""What counts as a tool call and as a tool error: the one definition the listing, ``show``,
``stats``, the UI and ``audit`` share.

A trajectory's tool calls are the calls its model made to tools: the calls its model answers
hold (an ``llm`` span's output: OpenAI chat ``tool_calls``, streamed or not, ``/v1/responses``
``function_call`` items, a message's or a parser's ``tool_calls``), or, where more, its ``tool``
spans (a framework that records the tools it ran, as verl does, with answers kept as token ids).

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

import base64
import binascii
import functools
import re
from collections.abc import Callable
from typing import Any

import pybase64

from rlreplay.format.payload import MARKER, unwrapped
from rlreplay.format.wire import NOT_JSON, read_json, stream_chunks

#: A response text that says the call failed.
ERROR_TEXT = re.compile(r"\s*(error|exception|traceback)\b", re.I)
#: The longest reason kept (the span's ``error`` column).
REASON_CHARS = 500
#: Mapping keys that say the call went well (false: it failed).
_OK_KEYS = ("ok", "success")


#: Keys a model's answer names its tool calls by (read below), and a key letter written as a JSON
#: escape (``\\u005f``): bytes of an answer that hold none of these call no tool.
WIRE_CALL_MARKS = (b"tool_calls", b"function_call", b'"calls"', b"\\u00")


def base64_forms(mark: bytes) -> list[str]:
    """What the base64 text of any bytes that hold ``mark`` holds, whichever of the three places in
    a 3-byte group it starts at: the characters made of ``mark``'s bits alone."""
    forms = []
    for k in range(3):
        text = base64.b64encode(b"\0" * k + mark + b"\0\0").decode()
        first, last = -(-8 * k // 6), (8 * (k + len(mark)) - 6) // 6
        forms.append(text[first : last + 1])
    return forms


#: Substrings one of which the text of an llm span's output holds when its answer may call a tool
#: (a cheap test before decoding): the keys read below, or the base64 form of
#: :data:`WIRE_CALL_MARKS` within an answer's bytes as the proxy keeps them (``"wire"``).
TOOL_CALL_MARKS = (
    "tool_calls",
    "function_call",
    '"calls"',
    *(form for mark in WIRE_CALL_MARKS for form in base64_forms(mark)),
)


def _calls_in(value: Any) -> int:
    """Tool calls in a message or parser output: a ``tool_calls`` (``function_calls``, ``calls``)
    list of calls."""
    for name in ("tool_calls", "function_calls", "calls"):
        calls = value.get(name)
        if isinstance(calls, list):
            return sum(1 for c in calls if isinstance(c, dict))
    return 0


def _response_items(response: Any) -> int:
    items = response.get("output") if isinstance(response, dict) else None
    if not isinstance(items, list):
        return 0
    return sum(1 for i in items if isinstance(i, dict) and i.get("type") == "function_call")


def _streamed_calls(chunks: list[Any]) -> int:
    """Tool calls in a streamed answer: distinct call indexes of the first choice's deltas (chat),
    else the finished response's function calls (``/v1/responses`` events)."""
    indexes: set[Any] = set()
    added = 0
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        kind = chunk.get("type")
        if kind == "response.completed":
            return _response_items(chunk.get("response"))
        if kind == "response.output_item.added":
            item = chunk.get("item")
            added += isinstance(item, dict) and item.get("type") == "function_call"
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            for n, call in enumerate((delta.get("tool_calls") or ()) if isinstance(delta, dict) else ()):
                if isinstance(call, dict):
                    indexes.add(call.get("index", call.get("id", n)))
    return len(indexes) or added


def _wire(value: Any) -> bytes | None:
    """The bytes of a kept ``wire`` field (bytes, or their JSON form), else None."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict) and value.get(MARKER) == "bytes" and isinstance(value.get("base64"), str):
        try:
            return pybase64.b64decode(value["base64"])
        except (binascii.Error, ValueError):
            return None
    return None


#: A member that names no call, as servers write it (vLLM: every message's ``"tool_calls":[]``).
#: Within a JSON string its quotes would be escaped: these bytes are always such a member.
_NO_CALLS = ('"tool_calls":[]', '"tool_calls":null')


@functools.cache
def _call_finder() -> Callable[[bytes], bool]:
    from rlreplay.format.marks import any_outside

    return any_outside(tuple(mark.decode() for mark in WIRE_CALL_MARKS), _NO_CALLS)


def _may_call(wire: bytes) -> bool:
    """Whether an answer's bytes may hold a tool call: a call key outside the members that name none."""
    return _call_finder()(wire)


def answer_tool_calls(output: Any) -> int:
    """How many tool calls a model's answer makes (an ``llm`` span's decoded output): see the
    module docstring. 0 for anything else."""
    value = unwrapped(output)
    if not isinstance(value, dict):
        return 0
    if isinstance(value.get("stream"), list):  # a streamed answer as the proxy records it
        return _streamed_calls(value["stream"])
    wire = _wire(value.get("wire"))
    if wire is not None and "body" not in value:  # the answer's bytes, as the proxy keeps them
        if not _may_call(wire):
            return 0
        if wire.lstrip()[:1] == b"{":
            body = read_json(wire)
            return answer_tool_calls({"body": body}) if body is not NOT_JSON else 0
        return _streamed_calls(stream_chunks(wire))
    if isinstance(value.get("body"), dict):  # the answer's body as the proxy records it
        value = value["body"]
    choices = value.get("choices")
    if isinstance(choices, list):
        first = choices[0] if choices and isinstance(choices[0], dict) else {}
        message = first.get("message")
        return _calls_in(message) if isinstance(message, dict) else 0
    if isinstance(value.get("output"), list):
        return _response_items(value)
    return _calls_in(value)


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
