"""Reading answers as they went over the wire: JSON as every reader reads it alike, server-sent
event streams. The proxy reads answers with these as they pass, readers the bytes a span keeps."""

from __future__ import annotations

from typing import Any

import orjson


class _NotJson:
    def __repr__(self) -> str:
        return "NOT_JSON"


#: What :func:`read_json` gives for bytes that are no JSON value it can read.
NOT_JSON: Any = _NotJson()


_AS_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_LONG_NUMBER = b"0" * 19  # 19 digits in a row: maybe an integer beyond 64 bits


def long_number(raw: bytes) -> bool:
    """Whether ``raw`` may hold an integer beyond 64 bits: 19 digits in a row, anywhere but after a
    decimal point (a fraction's digits, which orjson and Python round alike)."""
    digits = raw.translate(_AS_ZEROS)  # in C, no regex engine
    at = digits.find(_LONG_NUMBER)
    while at != -1:
        before = digits[at - 1 : at]
        if before != b"." and before != b"0":  # a run's first digits, not a fraction's
            return True
        at = digits.find(_LONG_NUMBER, at + 1)
    return False


def read_plain_json(raw: bytes, short_numbers: bool = False) -> Any:
    """The JSON value of ``raw`` when it holds only what every JSON reader reads alike (orjson's
    reading; no integer beyond 64 bits, NaN or lone surrogate), else :data:`NOT_JSON`.
    ``short_numbers``: the caller saw that ``raw`` holds no :func:`long_number`."""
    if not short_numbers and long_number(raw):  # orjson reads integers beyond 64 bits as floats
        return NOT_JSON
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return NOT_JSON


def read_json(raw: bytes, short_numbers: bool = False) -> Any:
    """The JSON value of ``raw``: orjson's reading, else Python's, which also reads what orjson
    refuses and clients send (integers beyond 64 bits, bare ``NaN``/``Infinity``, lone surrogates
    such as ``"\\ud83d"``); :data:`NOT_JSON` when neither can (not JSON, nested too deep).
    ``short_numbers``: the caller saw that ``raw`` holds no :func:`long_number`."""
    value = read_plain_json(raw, short_numbers)
    if value is not NOT_JSON:
        return value
    import json

    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return NOT_JSON


def canonical_json(value: Any) -> bytes:
    """``value`` (as a JSON reader gave it) as JSON with its keys sorted: equal values give the same
    bytes. Integers beyond 64 bits and lone surrogates, which orjson does not write, by Python's
    writer; numpy arrays as lists."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        import json

        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_as_list).encode()


def _as_list(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")


def sse_data(event: bytes) -> bytes | None:
    """The data of one SSE event (its ``data:`` lines joined), None when it has none."""
    lines = [line for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[5:].lstrip(b" ") for line in lines)


def sse_events(raw: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events of ``raw`` (without their blank line) and what is left after them."""
    if b"\r" in raw:
        raw = raw.replace(b"\r\n", b"\n")
    parts = raw.split(b"\n\n")
    return parts[:-1], parts[-1]


_NEXT_DATA = b"\n\ndata: "


def stream_datas(raw: bytes) -> list[bytes]:
    """The data of each event of a whole SSE answer, in order (an unfinished last event too)."""
    # every line break in a blank line before "data: " or at the end: each event is one data line
    # (the usual stream), split at once
    if (
        raw.startswith(b"data: ")
        and raw.endswith(b"\n\n")
        and b"\r" not in raw
        and raw.count(b"\n") == 2 * raw.count(_NEXT_DATA) + 2
    ):
        return raw[6:-2].split(_NEXT_DATA)
    return _event_by_event(raw)


def _event_by_event(raw: bytes) -> list[bytes]:
    events, rest = sse_events(raw)
    if rest.strip():
        events.append(rest)
    datas = []
    for event in events:
        if event.startswith(b"data: ") and b"\n" not in event:  # one data line: the usual event
            datas.append(event[6:])
        else:
            data = sse_data(event)
            if data is not None:
                datas.append(data)
    return datas


def read_chunk(data: bytes, short_numbers: bool = False) -> Any:
    """One event's data as a chunk: its JSON value, or its text when it is not JSON (``[DONE]``)."""
    value = read_json(data, short_numbers)
    return data.decode("utf-8", "replace") if value is NOT_JSON else value


def stream_chunks(raw: bytes) -> list[Any]:
    """The chunks of a whole SSE answer (:func:`read_chunk` of each event's data)."""
    short = not long_number(raw)  # looked for once, not event by event
    # each on its own: events that are no JSON alone may be some together
    return [read_chunk(data, short) for data in stream_datas(raw)]
