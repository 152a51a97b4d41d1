"""The proxy's guard on a real aiohttp server on 127.0.0.1 (``rlreplay.proxy.guard``): head and
body timeouts, the body limit, bounded logs, and the upstream URL's credentials."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from support import free_port

from rlreplay.proxy.guard import BoundedLog, Guard, GuardSettings, upstream_credentials, with_upstream_auth


@contextlib.contextmanager
def served(app: web.Application) -> Iterator[str]:
    """``app`` served on 127.0.0.1 by a thread of its own; its base URL."""
    port = free_port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


@pytest.fixture(scope="module")
def guarded() -> Iterator[str]:
    """A guarded application that echoes the body's size; its base URL."""

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"bytes": len(await request.read())})

    guard = Guard(GuardSettings(header_timeout_s=0.5, body_timeout_s=0.5, max_body_bytes=1000))
    app = guard.application()
    app.router.add_route("*", "/{tail:.*}", echo)
    with served(app) as url:
        yield url


def _raw(url: str, data: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes, or until one whole answer came."""
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
        head, sep, body = got.partition(b"\r\n\r\n")
        length = [
            int(v)
            for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        ]
        if sep and length and len(body) >= length[0]:
            break
    return got


def test_a_head_never_finished_is_closed(guarded: str) -> None:
    started = time.monotonic()
    with _raw(guarded, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n") as sock:
        assert _read_all(sock) == b""  # closed without an answer
    assert time.monotonic() - started < 5


def test_a_body_that_stalls_is_a_408_and_an_oversized_one_a_413(guarded: str) -> None:
    head = b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n"
    with _raw(guarded, head + b"0123456789") as sock:
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive" in answer
    big = httpx.post(f"{guarded}/x", content=b"x" * 5000)
    assert big.status_code == 413 and "over 1000 bytes" in big.json()["error"]["message"]
    assert httpx.post(f"{guarded}/x", content=b"x" * 999).json() == {"bytes": 999}


def test_logs_are_one_line_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("rlreplay.test.guard")
    logger.addFilter(BoundedLog(60.0))
    try:
        with caplog.at_level(logging.ERROR, logger="rlreplay.test.guard"):
            for n in range(10_000):
                try:
                    raise ConnectionResetError(f"peer {n} went away\nsecond line")
                except ConnectionResetError:
                    logger.exception("Error handling request")
                logger.error("another kind %d", n)
    finally:
        logger.filters.clear()
    lines = caplog.text.splitlines()
    assert len(caplog.records) == 2 and len(lines) == 2, caplog.text
    assert "Traceback" not in caplog.text and "ConnectionResetError: peer 0 went away" in lines[0]


@given(
    user=st.text(min_size=1, max_size=12),
    password=st.text(max_size=12),
)
def test_upstream_credentials_are_split_off_and_sent_as_basic(user: str, password: str) -> None:
    from urllib.parse import quote

    url = f"http://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:8000"
    clean, auth = upstream_credentials(url)
    assert clean == "http://127.0.0.1:8000"
    assert auth is not None and base64.b64decode(auth.removeprefix("Basic ")).decode() == f"{user}:{password}"
    assert with_upstream_auth({"Accept": "x"}, auth)["Authorization"] == auth
    assert with_upstream_auth({"authorization": "Bearer k"}, auth) == {"authorization": "Bearer k"}
    assert upstream_credentials("http://127.0.0.1:8000") == ("http://127.0.0.1:8000", None)


def test_proxy_uses_and_hides_upstream_credentials(start_proxy: Any, tmp_path: Any) -> None:
    """A stand-in upstream that says which Authorization it got: the URL's when the client sent
    none, the client's own otherwise; an unreachable upstream's 502, the logs and the run never
    show the password."""
    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        message = {"role": "assistant", "content": "4"}
        return web.json_response(
            {"id": "c", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    secret = "pw-7f3e9c2a"
    with served(app) as upstream:
        port = upstream.rsplit(":", 1)[1]
        proxy = start_proxy("--upstream", f"http://alice:{secret}@127.0.0.1:{port}", "--out", "run")
        body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}
        assert httpx.post(f"{proxy.url}/v1/chat/completions", json=body).status_code == 200
        own = httpx.post(
            f"{proxy.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer k1"}
        )
        assert own.status_code == 200
        assert seen == [f"Basic {base64.b64encode(f'alice:{secret}'.encode()).decode()}", "Bearer k1"]
        assert proxy.stop() == 0, proxy.stderr
        closed = start_proxy("--upstream", f"http://alice:{secret}@127.0.0.1:{free_port()}", "--out", "gone")
        failed = httpx.post(f"{closed.url}/v1/chat/completions", json=body)
        assert failed.status_code == 502 and secret not in failed.text and "alice" not in failed.text
        assert closed.stop() == 0
    shown = proxy.stderr + closed.stderr
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert secret not in shown and secret.encode() not in stored
