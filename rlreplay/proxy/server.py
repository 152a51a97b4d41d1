"""The proxy's HTTP face (aiohttp server and client): forwards every route to the upstream, records
generations, answers from a recording in a replay.

Generating routes (``rlreplay.proxy.protocol.GENERATING``) are parsed, asked for token ids and
log-probs, answered to the client as the upstream would have answered it (streams chunk by chunk,
as they arrive) and recorded; a body that is not a JSON object goes to the upstream as is,
unrecorded. Every other route passes through unchanged, both ways (weight updates advance the step).
``POST /rlreplay/step`` sets the step, ``POST /rlreplay/signals`` records rewards for a trajectory.
An upstream that cannot be reached is a 502 with one line, and the call leaves no trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from rlreplay.errors import ProxyError, UnknownTrajectory
from rlreplay.proxy.guard import Guard, GuardSettings, upstream_credentials, with_upstream_auth
from rlreplay.proxy.protocol import (
    GENERATING,
    StreamedAnswer,
    as_client_sees,
    ask_for_tokens,
    generated,
    is_streamed,
    is_weight_update,
)
from rlreplay.proxy.replaying import ProxyReplay
from rlreplay.proxy.trajectories import ID_HEADER, ProxyTrajectory, Trajectories, key_text, parse_key
from rlreplay.recorder.replay import DIVERGED, SERVED

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
    ours; a generating call asks for an uncompressed answer (the proxy reads it)."""
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if low in _HOP or low.startswith("x-rlreplay-") or (generating and low == "accept-encoding"):
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


def _sse_data(event: bytes) -> bytes | None:
    lines = [line for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[5:].lstrip(b" ") for line in lines)


def _split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (without their blank line) and what is left."""
    buffer = buffer.replace(b"\r\n", b"\n")
    parts = buffer.split(b"\n\n")
    return parts[:-1], parts[-1]


@dataclass
class ProxySettings:
    upstream: str | None
    replay: ProxyReplay | None = None
    connect_timeout_s: float = 10.0
    guard: GuardSettings | None = None


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
        self.session: aiohttp.ClientSession | None = None
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

    async def _close_session(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

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
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):  # not ours to judge: the upstream answers it
            return await self.forward(request, raw)
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
            return await self._answer(request, route, name, body, raw, traj)
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

    async def _answer(
        self,
        request: web.Request,
        route: str,
        name: str,
        body: dict[str, Any],
        raw: bytes,
        traj: ProxyTrajectory,
    ) -> web.StreamResponse:
        start = time.time_ns()
        status = reason = None
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
            played = self.replay.play(traj.replay, name, body)
            if played.served:
                record = played.output
                prompt_ids = self.replay.recorded_prompt_ids(traj.key, traj.replay)
                # joined before the answer ends: the client's next call may come at once
                self.trajectories.record(
                    traj, name, _inputs(body, prompt_ids), record, start, time.time_ns(), SERVED
                )
                self.trajectories.continues(traj, route, body, record)
                return await self._serve(request, record, traj)
            if played.reason is not None:
                status, reason = DIVERGED, played.reason
            if played.error is not None:
                self.replay.refuse()
                self.trajectories.record(
                    traj, name, dict(body), None, start, time.time_ns(), status, reason, played.error
                )
                return error_response(409, f"rlreplay proxy: {played.error}", "rlreplay_divergence")
        if self.upstream is None:
            return error_response(
                502, "rlreplay proxy: the recording does not answer this call and there is no --upstream"
            )
        upstream_body, added = ask_for_tokens(route, body)
        headers = with_upstream_auth(_request_headers(request.headers, True), self.upstream_auth)
        assert self.session is not None
        try:
            resp = await self.session.post(
                self._url(request), data=orjson.dumps(upstream_body), headers=headers
            )
            if resp.status == 400 and added:  # a server that refuses what the proxy asked for
                resp.release()
                added = frozenset()
                resp = await self.session.post(self._url(request), data=raw, headers=headers)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return self._unreachable(exc)
        try:
            if is_streamed(body) and resp.status == 200 and resp.content_type == _SSE:
                return await self._relay_stream(
                    request, resp, route, name, body, added, traj, start, status, reason
                )
            data = await resp.read()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            return self._unreachable(exc)
        finally:
            resp.release()
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            obj = None
        if obj is None:
            record: dict[str, Any] = {"status": resp.status, "text": data.decode("utf-8", "replace")}
            out_bytes = data
            found = None
        else:
            found = generated(route, body, obj)
            seen = as_client_sees(route, obj, added)
            out_bytes = data if seen is obj else orjson.dumps(seen)
            record = {"status": resp.status, "body": seen, **found.record()}
        response = web.Response(
            body=out_bytes, status=resp.status, headers=_response_headers(resp.headers, True)
        )
        self._mark(response, traj)
        self.trajectories.record(
            traj,
            name,
            _inputs(body, found.prompt_ids if found else None),
            record,
            start,
            time.time_ns(),
            status,
            reason,
        )
        self.trajectories.continues(traj, route, body, record)
        return response

    async def _relay_stream(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        route: str,
        name: str,
        body: dict[str, Any],
        added: frozenset[str],
        traj: ProxyTrajectory,
        start: int,
        status: str | None,
        reason: str | None,
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=resp.status, reason=resp.reason, headers=_response_headers(resp.headers, True)
        )
        self._mark(out, traj)
        await out.prepare(request)
        answer = StreamedAnswer(route, body)
        chunks: list[Any] = []
        buffer = b""
        error: BaseException | None = None
        try:
            async for piece in resp.content.iter_any():
                if not added:
                    await out.write(piece)  # the client first
                events, buffer = _split_events(buffer + piece)
                for event in events:
                    written = self._stream_event(route, event, added, answer, chunks)
                    if added:
                        await out.write(written)
            if added and buffer:
                await out.write(buffer)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ConnectionError) as exc:
            error = exc  # the upstream or the client went away: what came is recorded
        found = answer.generated()
        record = {"status": resp.status, "stream": chunks, **found.record()}
        if error is not None:
            record["interrupted"] = f"{type(error).__name__}: {error}"
        self.trajectories.record(
            traj, name, _inputs(body, found.prompt_ids), record, start, time.time_ns(), status, reason
        )
        if error is None:  # joined before the stream ends: the client's next call may come at once
            self.trajectories.continues(traj, route, body, record)
            with contextlib.suppress(OSError, ConnectionError):
                await out.write_eof()
        return out

    @staticmethod
    def _stream_event(
        route: str, event: bytes, added: frozenset[str], answer: StreamedAnswer, chunks: list[Any]
    ) -> bytes:
        """Record one SSE event; the bytes the client gets for it (when the proxy rewrites)."""
        data = _sse_data(event)
        if data is None:
            return event + b"\n\n"
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunks.append(data.decode("utf-8", "replace"))
            return event + b"\n\n"
        answer.add(obj)
        seen = as_client_sees(route, obj, added, streamed=True)
        chunks.append(seen)
        return event + b"\n\n" if seen is obj else b"data: " + orjson.dumps(seen) + b"\n\n"

    async def _serve(
        self, request: web.Request, record: dict[str, Any], traj: ProxyTrajectory
    ) -> web.StreamResponse:
        """A recorded answer, as the client got it then."""
        status = int(record.get("status") or 200)
        if "stream" in record:
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
        if "body" in record:
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


def _inputs(body: dict[str, Any], prompt_ids: Any) -> dict[str, Any]:
    """A span's inputs: the request as the client sent it, and the prompt's token ids when known."""
    if prompt_ids is None or "prompt_ids" in body:
        return body
    return {**body, "prompt_ids": prompt_ids}


# ---- running it -------------------------------------------------------------------------------------


async def serve(
    proxy: Proxy,
    host: str,
    port: int,
    ready: Any = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM); ``ready(url)`` once listening."""
    import signal

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(proxy.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ProxyError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    addresses = runner.addresses
    bound = addresses[0][1] if addresses else port
    if ready is not None:
        ready(f"http://{host}:{bound}")
    # what start-up made lives as long as the proxy: out of the cyclic collector's sight, every
    # collection that each answer's parsed JSON sets off scans only what calls made
    gc.freeze()
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
