"""What the proxy records of an answer, read from the bytes the client got: those bytes without
credentials, what the answer says of itself (ids, log-probs, finish reason) and the digest a later
call that continues it is found by. Functions of bytes and values alone, so that a reading process
(:mod:`rlreplay.proxy.readers`) can run them while the serving loop forwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from rlreplay.proxy.protocol import (
    NOT_JSON,
    Generated,
    StreamedAnswer,
    as_client_sees,
    generated,
    read_chunks,
    read_json,
    read_plain_json,
    stream_chunks,
)
from rlreplay.proxy.trajectories import Context, context_key


def kept_bytes(raw: bytes) -> bytes | None:
    """The bytes a span keeps of a request or an answer: ``raw`` with credentials taken out, or
    None when they cannot be taken out (nothing is kept rather than a secret)."""
    from rlreplay.format.redact import redact_json_bytes

    try:
        return redact_json_bytes(raw)
    except Exception:
        return None


@dataclass
class Kept:
    """``kept_bytes`` of some bytes, sent back only when they differ from what was asked about."""

    same: bool
    kept: bytes | None

    def of(self, raw: bytes) -> bytes | None:
        return raw if self.same else self.kept


def keep(raw: bytes) -> Kept:
    kept = kept_bytes(raw)
    return Kept(True, None) if kept is raw else Kept(False, kept)


@dataclass
class StreamRead:
    """A streamed answer read whole: what it says (None: read on the way), its bytes as kept
    (``stream``: its chunks as values, when the bytes cannot be kept), its continuation's digest,
    and the request's bytes as kept."""

    found: Generated | None
    kept: Kept
    stream: list[Any] | None
    context: Context | None
    request: Kept


def read_stream(route: str, body: dict[str, Any], request: bytes, wire: bytes, continued: bool) -> StreamRead:
    """Read the SSE answer ``wire`` to the request ``body`` (its bytes: ``request``);
    ``continued``: a later call may continue it, so find its digest."""
    kept = keep(wire)
    shown = kept.of(wire)
    # the chunks, each as a value, are kept where the bytes cannot be; else only what is read of them
    chunks = stream_chunks(wire) if shown is None else read_chunks(route, wire)
    answer = StreamedAnswer(route, body)
    answer.add_all(chunks)
    found = answer.generated()
    stream = chunks if shown is None else None
    context = None
    if continued:
        record = {**found.record(), **({"wire": shown} if shown is not None else {"stream": stream})}
        context = context_key(route, body, record, chunks)
    return StreamRead(found, kept, stream, context, keep(request))


def read_kept_stream(request: bytes, wire: bytes) -> StreamRead:
    """An SSE answer the proxy read on the way: its bytes as kept (its chunks as values when they
    cannot be), and the request's."""
    kept = keep(wire)
    stream = stream_chunks(wire) if kept.of(wire) is None else None
    return StreamRead(None, kept, stream, None, keep(request))


@dataclass
class WholeRead:
    """A whole answer read: ``found`` None when it is no JSON; ``out`` the client's bytes where
    they differ from the upstream's (what the proxy asked for taken out); ``body`` the client's
    value where its bytes cannot be kept; the request's bytes as kept."""

    found: Generated | None
    out: bytes | None
    kept: Kept
    body: Any
    context: Context | None
    request: Kept


def read_whole(
    route: str, body: dict[str, Any], request: bytes, added: frozenset[str], data: bytes, continued: bool
) -> WholeRead:
    """Read the whole answer ``data`` (its Content-Encoding undone) to the request ``body`` (its
    bytes: ``request``); ``added``: what the proxy asked for that the client did not."""
    plain = read_plain_json(data)
    obj = plain if plain is not NOT_JSON else read_json(data)
    found = seen = out = None
    if obj is not NOT_JSON:
        found = generated(route, body, obj)
        seen = as_client_sees(route, obj, added)
        out = json_bytes(seen, plain is not NOT_JSON) if seen is not obj else None
    shown = data if out is None else out
    kept = keep(shown)
    kept_shown = kept.of(shown)
    context = None
    if continued:  # the record as the proxy keeps it, with the answer's value
        record = found.record() if found is not None else {}
        if kept_shown is not None:
            record["wire"] = kept_shown
        context = context_key(route, body, {**record, "body": seen} if found is not None else record)
    return WholeRead(found, out, kept, seen if kept_shown is None else None, context, keep(request))


def json_bytes(value: Any, plain: bool) -> bytes:
    """``value`` as JSON; ``plain``: it was read by orjson (else it may hold NaN or Infinity, which
    orjson writes as null, and what orjson cannot write: integers beyond 64 bits, lone surrogates)."""
    if plain:
        try:
            return orjson.dumps(value)
        except TypeError:
            pass
    import json

    return json.dumps(value, separators=(",", ":")).encode()
