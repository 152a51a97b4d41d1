"""A scripted upstream on 127.0.0.1 for the proxy's wire tests: it answers each request with what
the test scripted for its ``X-Test`` header (a status, a content type, the answer's pieces, and
whether to break the connection after them) and keeps the bytes and headers it got, exactly (its
server does not undo a Content-Encoding)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Script:
    pieces: list[bytes]
    status: int = 200
    content_type: str = "application/json"
    cut: bool = False  # end the connection after the pieces, the answer unfinished
    pause_s: float = 0.0  # between pieces
    hold_s: float = 0.0  # after the last piece, before the answer ends
    headers: dict[str, str] = field(default_factory=dict)


class Upstream:
    """``script(tag, Script)`` then call with ``X-Test: tag``; ``got[tag]``: (headers, body bytes)."""

    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self.got: dict[str, tuple[dict[str, str], bytes]] = {}
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(ready),), daemon=True)
        self._thread.start()
        assert ready.wait(30), "the scripted upstream did not start"

    def script(self, tag: str, script: Script) -> None:
        self.scripts[tag] = script

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        tag = request.headers.get("X-Test", "")
        self.got[tag] = (dict(request.headers), await request.read())
        script = self.scripts.get(tag) or Script([b'{"ok":true}'])
        headers = {"Content-Type": script.content_type, **script.headers}
        if script.content_type != "text/event-stream" and not script.cut:
            return web.Response(status=script.status, body=b"".join(script.pieces), headers=headers)
        out = web.StreamResponse(status=script.status, headers=headers)
        await out.prepare(request)
        for piece in script.pieces:
            await out.write(piece)
            if script.pause_s:
                await asyncio.sleep(script.pause_s)
        if script.hold_s:
            await asyncio.sleep(script.hold_s)
        if script.cut:
            assert request.transport is not None
            request.transport.abort()
            return out
        await out.write_eof()
        return out

    async def _main(self, ready: threading.Event) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._answer)
        runner = web.AppRunner(app, access_log=None, auto_decompress=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
