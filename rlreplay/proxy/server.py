"""The proxy's HTTP face (aiohttp server and client): forwards every route to the upstream, records
generations, answers from a recording in a replay.

Generating routes (``rlreplay.proxy.protocol.GENERATING``) are parsed, asked for token ids and
log-probs, answered to the client as the upstream would have answered it (streams chunk by chunk,
as they arrive) and recorded, what is recorded of the answer read in a reading process
(``rlreplay.proxy.readers``); a body that is not a JSON object goes to the upstream as is,
unrecorded. Every other route passes through unchanged, both ways (weight updates advance the step).
``POST /rlreplay/step`` sets the step, ``POST /rlreplay/signals`` records rewards for a trajectory.
An upstream that cannot be reached is a 502 with one line, and the call leaves no trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from rlreplay.errors import ProxyCallFailed, ProxyError, UnknownTrajectory
from rlreplay.proxy.answers import (
    Kept,
    json_bytes,
    keep,
    kept_bytes,
    read_kept_stream,
    read_stream,
    read_whole,
)
from rlreplay.proxy.guard import Guard, GuardSettings, upstream_credentials, with_upstream_auth
from rlreplay.proxy.protocol import (
    CHAT,
    COMPLETIONS,
    GENERATING,
    NOT_JSON,
    RESPONSES,
    SHAPE_REFUSED,
    Generated,
    StreamedAnswer,
    ask_for_tokens,
    chunk_reader,
    is_streamed,
    is_weight_update,
    long_number,
    read_json,
    read_plain_json,
    sse_data,
    sse_events,
    taken_out,
    with_members,
)
from rlreplay.proxy.readers import Readers
from rlreplay.proxy.replaying import ProxyReplay
from rlreplay.proxy.trajectories import ID_HEADER, ProxyTrajectory, Trajectories, key_text, parse_key
from rlreplay.recorder.events import WRITE, Control
from rlreplay.recorder.replay import DIVERGED, SERVED

#: How long an answer's end waits for the call to be in the run's live file (a stalled disk)
DURABLE_WAIT_S = 5.0

_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
_SSE = "text/event-stream"


def _request_headers(headers: Any, generating: bool) -> dict[str, str]:
    """What the upstream gets: the client's headers (keys and auth included) but hop-by-hop ones and
    ours; a generating call asks for an uncompressed answer (the proxy reads it). The body goes as
    aiohttp read it, its Content-Encoding undone: that header is not passed on."""
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if (
            low in _HOP
            or low == "content-encoding"
            or low.startswith("x-rlreplay-")
            or (generating and low == "accept-encoding")
        ):
            continue
        out[name] = value
    return out


def _response_headers(headers: Any, rewritten: bool) -> dict[str, str]:
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if low in _HOP or (rewritten and low == "content-encoding"):
            continue
        out[name] = value
    return out


def error_response(status: int, message: str, kind: str = "rlreplay_proxy") -> web.Response:
    """An OpenAI-style error body with one line."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@dataclass
class ProxySettings:
    upstream: str | None
    replay: ProxyReplay | None = None
    connect_timeout_s: float = 10.0
    durable_wait_s: float = DURABLE_WAIT_S
    guard: GuardSettings | None = None
    readers: int | None = None  # reading processes (None: as the machine's cores allow)


class Proxy:
    """Forwards to ``settings.upstream``, records into ``trajectories`` (and replays from
    ``settings.replay``)."""

    def __init__(self, settings: ProxySettings, trajectories: Trajectories) -> None:
        upstream, self.upstream_auth = upstream_credentials(settings.upstream)  # never shown
        self.upstream = upstream.rstrip("/") if upstream else None
        self.guard = Guard(settings.guard)
        self.replay = settings.replay
        self.trajectories = trajectories
        self.connect_timeout_s = settings.connect_timeout_s
        self.durable_wait_s = settings.durable_wait_s
        self.session: aiohttp.ClientSession | None = None
        self.readers = Readers(settings.readers)
        self.calls = 0

    def app(self) -> web.Application:
        app = self.guard.application()
        app.router.add_post("/rlreplay/step", self.step)
        app.router.add_post("/rlreplay/signals", self.signals)
        for route in GENERATING:
            app.router.add_post(route, self.generation)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)
        await self.readers.start()

    async def _close_session(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()
        await self.readers.stop()

    def _url(self, request: web.Request) -> str:
        return f"{self.upstream}{request.rel_url}"

    def _unreachable(self, exc: BaseException) -> web.Response:
        reason = type(exc).__name__ if not str(exc) else str(exc).splitlines()[0]
        return error_response(
            502, f"rlreplay proxy: upstream {self.upstream} did not answer: {reason}", "upstream_unreachable"
        )

    # -- our own routes -------------------------------------------------------------------------

    async def step(self, request: web.Request) -> web.Response:
        raw = await request.read()
        step = None
        if raw.strip():
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:
                return error_response(400, 'POST /rlreplay/step: the body is not JSON ({"step": N})')
            step = data.get("step") if isinstance(data, dict) else None
            if step is not None and (type(step) is not int):
                return error_response(400, f"POST /rlreplay/step: step must be a whole number, not {step!r}")
        return web.json_response({"step": self.trajectories.set_step(step)})

    async def signals(self, request: web.Request) -> web.Response:
        try:
            data = orjson.loads(await request.read())
            if not isinstance(data, dict):
                raise ProxyError("the body is not a JSON object")
            trajectory_id = self.trajectories.signals(data)
        except (orjson.JSONDecodeError, ProxyError) as exc:
            return error_response(
                404 if isinstance(exc, UnknownTrajectory) else 400, f"POST /rlreplay/signals: {exc}"
            )
        return web.json_response({"trajectory_id": trajectory_id})

    # -- everything else passes through ------------------------------------------------------------

    async def forward(self, request: web.Request, raw: bytes | None = None) -> web.StreamResponse:
        if self.upstream is None:
            return error_response(
                502, f"rlreplay proxy: no --upstream to send {request.method} {request.path} to"
            )
        if raw is None:
            raw = await request.read()
        assert self.session is not None
        try:
            resp = await self.session.request(
                request.method,
                self._url(request),
                data=raw if raw else None,
                headers=with_upstream_auth(_request_headers(request.headers, False), self.upstream_auth),
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return self._unreachable(exc)
        try:
            out = web.StreamResponse(
                status=resp.status, reason=resp.reason, headers=_response_headers(resp.headers, False)
            )
            await out.prepare(request)
            async for piece in resp.content.iter_any():
                await out.write(piece)
            await out.write_eof()
        finally:
            resp.release()
        if is_weight_update(request.path) and 200 <= resp.status < 300:
            self.trajectories.weights_updated()
        return out

    # -- generations ------------------------------------------------------------------------------

    async def generation(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()  # aiohttp has undone a Content-Encoding: what the client meant
        body = read_json(raw)
        parsed = isinstance(body, dict)
        if not parsed:  # not JSON, not an object, nested too deep: forwarded as is, kept as bytes
            body = {}
        route = request.path
        try:
            text = key_text(request.headers, body)
            named = parse_key(text) if text else None
            traj, new = self.trajectories.find(route, body, named, request.headers.get(ID_HEADER))
        except ProxyError as exc:
            return error_response(
                404 if isinstance(exc, UnknownTrajectory) else 400, f"rlreplay proxy: {exc}"
            )
        name = GENERATING[route]
        traj.busy += 1
        try:
            if new:
                self._begin(traj, name, body, named)
            return await self._answer(request, Call(route, name, body, raw, traj, parsed=parsed))
        finally:
            traj.busy -= 1
            self.trajectories.drop_if_empty(traj)

    def _begin(self, traj: ProxyTrajectory, name: str, body: dict[str, Any], named: Any) -> None:
        if self.replay is None:
            if named is None:
                self.trajectories.name(traj)
            return
        if named is None:
            self.trajectories.name(traj, self.replay.source_for(name, body))
        traj.replay = self.replay.open(traj.key)

    async def _answer(self, request: web.Request, call: Call) -> web.StreamResponse:
        traj, name, body = call.traj, call.name, call.body
        if (
            traj.replay is not None
            and traj.replay.source is None
            and not traj.replay.diverged  # diverged on opening (an unreadable source): played below
            and self.replay is not None
        ):
            if self.replay.cassette.on_diverge == "fail":
                self.replay.refuse()
                what = (
                    f"no trajectory {traj.key}"
                    if traj.explicit
                    else "no trajectory that starts with this call"
                )
                return error_response(
                    409, f"rlreplay proxy: the recording holds {what}", "rlreplay_divergence"
                )
        elif traj.replay is not None and self.replay is not None:
            played = self.replay.play(traj.replay, name, call.inputs(None))
            if played.served:
                record = played.output
                prompt_ids = self.replay.recorded_prompt_ids(traj.key, traj.replay)
                # joined before the answer ends: the client's next call may come at once
                self.trajectories.record(
                    traj, name, call.inputs(prompt_ids), record, call.start, time.time_ns(), SERVED
                )
                self.trajectories.continues(traj, call.route, body, record)
                return await self._serve(request, record, traj)
            if played.reason is not None:
                call.status, call.reason = DIVERGED, played.reason
            if played.error is not None:
                self.replay.refuse()
                self.trajectories.record(
                    traj,
                    name,
                    call.inputs(None),
                    None,
                    call.start,
                    time.time_ns(),
                    call.status,
                    call.reason,
                    played.error,
                )
                return error_response(409, f"rlreplay proxy: {played.error}", "rlreplay_divergence")
        if self.upstream is None:
            return error_response(
                502, "rlreplay proxy: the recording does not answer this call and there is no --upstream"
            )
        members, added = ask_for_tokens(call.route, body) if call.parsed else (b"", frozenset())
        sent = with_members(call.raw, members, not body) if added else call.raw
        if sent is None:
            sent, added = call.raw, frozenset()
        headers = with_upstream_auth(_request_headers(request.headers, generating=True), self.upstream_auth)
        assert self.session is not None
        try:
            resp = await self.session.post(self._url(request), data=sent, headers=headers)
            if resp.status == 400 and added:  # a server that refuses what the proxy asked for
                resp.release()
                added = frozenset()
                resp = await self.session.post(self._url(request), data=call.raw, headers=headers)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return self._unreachable(exc)
        call.added = added
        try:
            if (
                is_streamed(body)
                and resp.status == 200
                and resp.content_type == _SSE
                and resp.headers.get("Content-Encoding", "identity").strip().lower() in ("", "identity")
            ):
                return await self._relay_stream(request, resp, call)
            try:
                data = await resp.read()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                self._record_failure(call, f"the upstream's answer broke off: {_why(exc)}")
                return self._unreachable(exc)
        finally:
            resp.release()
        return await self._answer_whole(request, resp, call, data)

    async def _answer_whole(
        self, request: web.Request, resp: aiohttp.ClientResponse, call: Call, data: bytes
    ) -> web.StreamResponse:
        """A whole (not streamed) answer: recorded, made durable, then given to the client."""
        encoding = resp.headers.get("Content-Encoding", "").strip().lower()
        decoded = _decoded(data, encoding)
        headers = _response_headers(resp.headers, rewritten=decoded is not data)
        record: dict[str, Any] = {"status": resp.status, **_content_type(resp)}
        found, context = None, None
        if decoded is None:  # an encoding the proxy cannot undo: kept as it came
            out_bytes, kept = data, (await self.readers.run(keep, data)).of(data)
        else:
            continued = resp.status < 400 and not call.traj.explicit
            read = await self.readers.run(
                read_whole, call.route, call.body, call.raw, call.added, decoded, continued
            )
            found, context, call.request_kept = read.found, read.context, read.request
            out_bytes = decoded if read.out is None else read.out
            kept = read.kept.of(out_bytes)
            if found is not None:
                record.update(found.record())
                if kept is None:
                    record["body"] = read.body  # what cannot be kept as bytes, as a value
        if kept is not None:
            record["wire"] = kept  # the answer once, as the client got it: its bytes
        response = web.Response(body=out_bytes, status=resp.status, headers=headers)
        self._mark(response, call.traj)
        error = None
        if resp.status >= 400:
            error = ProxyCallFailed(f"the upstream answered {resp.status}: {_first_line(out_bytes)}")
        self._record(call, found, record, error)
        if error is None:
            self.trajectories.continues_at(call.traj, context)
        await self._durable()
        return response

    async def _relay_stream(
        self, request: web.Request, resp: aiohttp.ClientResponse, call: Call
    ) -> web.StreamResponse:
        """A streamed answer: each piece to the client as it comes (the proxy's own rewriting, when
        it asked for ids or log-probs, event by event); recorded when the stream ends, and made
        durable before the client gets its end (the ``[DONE]`` event and the end of the body)."""
        out = web.StreamResponse(
            status=resp.status, reason=resp.reason, headers=_response_headers(resp.headers, True)
        )
        self._mark(out, call.traj)
        await out.prepare(request)
        sent: list[bytes] = []  # what the client got, in order
        held: list[bytes] = []  # what waits for the call to be durable: the answer's end
        rewriting = bool(call.added)
        # a rewritten stream is read on the way (each event is read to rewrite it), what the
        # upstream said before what the proxy asked for is taken out
        answer = StreamedAnswer(call.route, call.body) if rewriting else None
        buffer = b""
        responses = call.route == RESPONSES  # its stream ends with its ``response.completed`` event
        carry = b""  # the start of what may be the answer's end, waiting for the next piece
        failure: str | None = None
        upstream_failed = False
        try:
            async for piece in resp.content.iter_any():
                if rewriting:
                    events, buffer = sse_events(buffer + piece)
                    piece = _client_events(call, events, answer)
                    if not piece:
                        continue
                if carry:
                    piece, carry = carry + piece, b""
                if held or _DONE in piece or (responses and _COMPLETED in piece):  # the answer's end
                    held.append(piece)
                    continue
                begun = _end_begun(piece, _DONE)
                if responses:
                    begun = max(begun, _end_begun(piece, _COMPLETED))
                if begun:
                    piece, carry = piece[:-begun], piece[-begun:]
                    if not piece:
                        continue
                sent.append(piece)
                await out.write(piece)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, asyncio.TimeoutError) as exc:
            failure, upstream_failed = f"the upstream's stream broke off: {_why(exc)}", True
        except (ConnectionError, OSError, aiohttp.ClientConnectionResetError) as exc:
            failure = f"the client went away before the answer ended: {_why(exc)}"
        except aiohttp.ClientError as exc:
            failure, upstream_failed = f"the upstream's stream broke off: {_why(exc)}", True
        held += [tail for tail in (carry, buffer) if tail]  # buffer: a rewritten stream's unfinished event
        end = time.time_ns()
        wire = b"".join(sent) + b"".join(held)
        if answer is not None:
            read = await self.readers.run(read_kept_stream, call.raw, wire)
            found = answer.generated()
        else:
            continued = failure is None and not call.traj.explicit
            read = await self.readers.run(read_stream, call.route, call.body, call.raw, wire, continued)
            found, context = read.found, read.context
        kept_read, stream, call.request_kept = read.kept, read.stream, read.request
        record = {"status": resp.status, **_content_type(resp), **found.record()}
        kept = kept_read.of(wire)
        if kept is not None:
            record["wire"] = kept
        else:  # the chunks, each as a value (what cannot be kept as bytes)
            record["stream"] = stream
        error = None
        if failure is not None:
            got = sum(map(len, sent))
            error = ProxyCallFailed(f"{failure} ({got} bytes of the answer had reached the client)")
        self._record(call, found, record, error, end)
        if error is not None:
            if upstream_failed:  # the client sees the stream fail, as it would without the proxy
                _abort(request)
            return out
        if answer is not None:
            # what the next call's prompt is matched against: the chunks read on the way when the
            # wire holds only their events (an unfinished last one: what is kept)
            read_on_way = None if buffer else answer.chunks
            self.trajectories.continues(call.traj, call.route, call.body, record, read_on_way)
        else:
            self.trajectories.continues_at(call.traj, context)
        await self._durable()
        try:
            for piece in held:
                await out.write(piece)
            await out.write_eof()
        except (ConnectionError, OSError, aiohttp.ClientConnectionResetError):
            pass  # recorded as answered: every byte was the client's to read
        return out

    def _record(
        self,
        call: Call,
        found: Generated | None,
        record: dict[str, Any],
        error: BaseException | None,
        end: int | None = None,
    ) -> None:
        self.trajectories.record(
            call.traj,
            call.name,
            call.inputs(found.prompt_ids if found is not None else None),
            None if error is not None else record,
            call.start,
            end or time.time_ns(),
            call.status,
            call.reason,
            error,
        )

    def _record_failure(self, call: Call, why: str) -> None:
        self._record(call, None, {}, ProxyCallFailed(why))

    async def _durable(self) -> None:
        """Wait (at most ``DURABLE_WAIT_S``) until what was recorded is in the run's live file, so
        that a proxy killed after answering loses no answered call; a disk that does not answer in
        time does not hold the answer back longer."""
        handoff = self.trajectories.handoff
        recorder = self.trajectories.recorder
        if handoff is None or recorder is None or self.durable_wait_s <= 0:
            return
        loop = asyncio.get_running_loop()
        written = loop.create_future()
        handoff.give(Control(WRITE, _Written(loop, written)))
        recorder.wake()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(written, self.durable_wait_s)

    async def _serve(
        self, request: web.Request, record: dict[str, Any], traj: ProxyTrajectory
    ) -> web.StreamResponse:
        """A recorded answer, as the client got it then: its bytes."""
        if not isinstance(record, dict):
            return error_response(409, "rlreplay proxy: the recorded call has no answer to serve")
        status = int(record.get("status") or 200)
        wire = record.get("wire")
        content_type = record.get("content_type")
        if not isinstance(content_type, str):  # recorded before the proxy kept it
            whole = isinstance(record.get("body"), dict) and "stream" not in record
            content_type = "application/json" if whole else _SSE
        if isinstance(wire, bytes) and content_type.split(";")[0].strip().lower() == _SSE:
            out = web.StreamResponse(
                status=status, headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
            )
            self._mark(out, traj)
            await out.prepare(request)
            await out.write(wire)
            await out.write_eof()
            return out
        if isinstance(wire, bytes):
            response = web.Response(status=status, body=wire, headers={"Content-Type": content_type})
        elif "stream" in record:  # recorded before the proxy kept the bytes
            out = web.StreamResponse(
                status=status, headers={"Content-Type": _SSE, "Cache-Control": "no-cache"}
            )
            self._mark(out, traj)
            await out.prepare(request)
            for chunk in record["stream"]:
                data = chunk.encode() if isinstance(chunk, str) else orjson.dumps(chunk)
                await out.write(b"data: " + data + b"\n\n")
            await out.write_eof()
            return out
        elif "body" in record:
            response = web.Response(
                status=status, body=orjson.dumps(record["body"]), content_type="application/json"
            )
        else:
            response = web.Response(status=status, text=str(record.get("text") or ""))
        self._mark(response, traj)
        return response

    def _mark(self, response: web.StreamResponse, traj: ProxyTrajectory) -> None:
        """Tell the client which trajectory its call joined (for signals posted later)."""
        response.headers[ID_HEADER] = self.trajectories.allocate(traj)


@dataclass
class Call:
    """One generating call on its way through the proxy."""

    route: str
    name: str
    body: dict[str, Any]
    raw: bytes  # the request's bytes as the client sent them
    traj: ProxyTrajectory
    parsed: bool = True  # the body was read as a JSON object (else ``body`` is empty)
    start: int = field(default_factory=time.time_ns)
    added: frozenset[str] = frozenset()
    request_kept: Kept | None = None  # ``raw`` as kept, when read already
    status: str | None = None  # a replay's mark
    reason: str | None = None

    def inputs(self, prompt_ids: Any) -> dict[str, Any]:
        """The span's inputs: the request as the client sent it (its values, and its bytes under
        ``wire``), and the prompt's token ids when known."""
        out = self.body if self.parsed else {}
        extra: dict[str, Any] = {}
        if prompt_ids is not None and "prompt_ids" not in out:
            extra["prompt_ids"] = prompt_ids
        kept = None
        if "wire" not in out:
            kept = kept_bytes(self.raw) if self.request_kept is None else self.request_kept.of(self.raw)
        if kept is not None:
            extra["wire"] = kept
        return {**out, **extra} if extra else out


#: What a stream's last event holds.
_DONE, _COMPLETED = b"[DONE]", b"response.completed"


def _end_begun(piece: bytes, end: bytes) -> int:
    """How many of ``piece``'s last bytes begin ``end`` (the rest of it may come in the next piece)."""
    at = piece.find(end[:1], max(0, len(piece) - len(end) + 1))
    while at != -1:
        if end.startswith(piece[at:]):
            return len(piece) - at
        at = piece.find(end[:1], at + 1)
    return 0


def _client_events(call: Call, events: list[bytes], answer: StreamedAnswer) -> bytes:
    """SSE events (without their blank lines) as the client gets them: without what the proxy asked
    for, each chunk read into ``answer`` on the way."""
    out = []
    added = call.added
    read_shaped = chunk_reader(call.route) if call.route in (CHAT, COMPLETIONS) else None
    shaped: list[Any] = []  # chunks read against their shape, added to ``answer`` together
    short: bool | None = None
    for event in events:
        if event.startswith(b"data: ") and b"\n" not in event and b"\r" not in event:
            data: bytes | None = event[6:].lstrip(b" ")  # one data line: the usual event
        else:
            data = sse_data(event)
        if read_shaped is not None and data is not None and data != b"[DONE]":
            try:  # the usual chunk: read against its shape, its other members' bytes kept
                seen_bytes = taken_out(data, added)
                chunk = read_shaped(data)
            except SHAPE_REFUSED:
                pass
            else:
                shaped.append(chunk)
                out.append(event + b"\n\n" if seen_bytes is None else b"data: " + seen_bytes + b"\n\n")
                continue
        if shaped:
            answer.add_all(shaped)
            shaped = []
        if short is None:
            short = not long_number(b"".join(events))  # looked for once, not event by event
        obj = NOT_JSON if data is None else read_plain_json(data, short)
        plain = obj is not NOT_JSON
        if not plain and data is not None:
            obj = read_json(data)  # NaN, lone surrogates: what orjson does not read
        seen = None if obj is NOT_JSON else answer.take(obj, added)
        out.append(event + b"\n\n" if seen is None else b"data: " + json_bytes(seen, plain) + b"\n\n")
    answer.add_all(shaped)
    return b"".join(out)


class _Written:
    """Set by the recorder's writer thread once what came before is written: resolves ``future``
    on its event loop."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        self.loop, self.future = loop, future

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed
            self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


def _content_type(resp: aiohttp.ClientResponse) -> dict[str, str]:
    """The answer's Content-Type as the client got it (a replay serves it so), when it had one."""
    value = resp.headers.get("Content-Type")
    return {"content_type": value} if value else {}


def _decoded(data: bytes, encoding: str) -> bytes | None:
    """``data`` without its Content-Encoding (gzip, deflate); ``data`` itself when it has none, None
    when the proxy cannot undo it."""
    if encoding in ("", "identity"):
        return data
    import zlib

    try:
        if encoding in ("gzip", "x-gzip"):
            return zlib.decompress(data, 16 + zlib.MAX_WBITS)
        if encoding == "deflate":
            return zlib.decompress(data)
    except zlib.error:
        return None
    return None


def _first_line(data: bytes) -> str:
    text = data[:300].decode("utf-8", "replace").strip()
    return text.splitlines()[0] if text else "(no body)"


def _why(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _abort(request: web.Request) -> None:
    """End the client's connection without ending the answer: it sees the stream fail."""
    transport = request.transport
    if transport is not None:
        transport.abort()


# ---- running it -------------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """The proxy's listening socket (bound before anything of the run is made: a port in use leaves
    nothing behind); raises ProxyError naming the address."""
    try:
        return socket.create_server((host, port), backlog=1024)
    except OSError as exc:
        raise ProxyError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None


YOUNG_OBJECTS_BEFORE_GC = 20_000


async def serve(
    proxy: Proxy,
    host: str,
    port: int,
    ready: Any = None,
    stop: asyncio.Event | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve on ``sock`` (else a socket made with :func:`listen`) until ``stop`` is set (or
    SIGINT/SIGTERM); ``ready(url)`` once listening."""
    import signal

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    sock = sock if sock is not None else listen(host, port)
    runner = web.AppRunner(proxy.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ProxyError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    bound = sock.getsockname()[1]
    if ready is not None:
        ready(f"http://{host}:{bound}")
    # what start-up made lives as long as the proxy: out of the cyclic collector's sight, every
    # collection that each answer's parsed JSON sets off scans only what calls made
    gc.freeze()
    # parsed answers hold no cycles: collect young objects 30x less often (at 256 streams the
    # collector took ~25% of the proxy's CPU at the default 700; benchmarks/README.md)
    gc.set_threshold(YOUNG_OBJECTS_BEFORE_GC, *gc.get_threshold()[1:])
    watch = asyncio.ensure_future(proxy.guard.watch(runner.server))  # half-open connections
    tick = max(0.2, min(5.0, proxy.trajectories.idle_s / 4))
    try:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), tick)
            proxy.trajectories.close_idle()
    finally:
        watch.cancel()
        await runner.cleanup()
        proxy.trajectories.close_all()
    print("rlreplay proxy: stopped", file=sys.stderr, flush=True)
