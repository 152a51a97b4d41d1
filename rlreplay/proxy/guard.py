"""The proxy's hardening: who may call it, how long and how much a client may take, how much it logs,
and the upstream's credentials.

- **Host and Origin**: on a loopback address (the default) a request's ``Host`` must name this
  machine's loopback (``localhost``, ``127.0.0.1``, ``[::1]``), so that a web page whose name
  resolves here (DNS rebinding) is refused; a request that carries an ``Origin`` (every browser
  sends one with a cross-origin POST, ``text/plain`` too) is refused unless that origin is the
  proxy itself; so is one a browser marks ``Sec-Fetch-Site: cross-site``. A refused request is
  a 403 with one line and reaches neither the upstream nor the recording (it cannot set the step).
- **Time**: a connection that has not sent a whole request head within ``header_timeout_s`` is
  closed (aiohttp's keep-alive timer, which also closes idle keep-alive connections then); a body
  not received within ``body_timeout_s`` is a 408.
- **Size**: a body over ``max_body_bytes`` is a 413; beyond ``max_connections`` open connections
  (and never past the process's file limit, which is raised to its hard limit), the oldest idle
  ones are closed, so that half-open connections never keep new clients out.
- **Logs**: aiohttp's and asyncio's log records are one line each, without tracebacks, at most one
  per kind every ``log_every_s`` (with a count of those held back).
- **Upstream credentials**: ``http://user:password@host`` is split into the URL without them and
  a Basic ``Authorization`` header, sent upstream only when the client sends no ``Authorization``
  of its own (its key is the one the upstream should judge); the credentials are never shown.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from aiohttp import web

from rlreplay.errors import ProxyError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})  # listening everywhere: any Host names this machine
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class GuardSettings:
    """Limits of the proxy's HTTP face (see the module docstring)."""

    host: str = "127.0.0.1"  # the address the proxy listens on
    header_timeout_s: float = 30.0
    body_timeout_s: float = 120.0
    max_body_bytes: int = 1 << 30
    max_connections: int = 8192
    log_every_s: float = 10.0

    def allowed_host(self, host_header: str) -> bool:
        """Whether a ``Host`` header names this proxy (any, when it listens on a non-loopback address)."""
        if self.host not in LOOPBACK_NAMES:
            return True
        name = _host_name(host_header)
        return name in LOOPBACK_NAMES


def _host_name(host_header: str) -> str:
    """The name part of ``host[:port]`` (``[v6]`` kept in brackets), lower case."""
    text = host_header.strip().lower()
    if text.startswith("["):
        return text[: text.find("]") + 1] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _refuse(status: int, message: str) -> web.Response:
    body = {"error": {"message": f"rlreplay proxy: {message}", "type": "rlreplay_refused", "code": status}}
    response = web.json_response(body, status=status)
    if status in (408, 413):  # the rest of the body may still come: the connection is done
        response.force_close()
    return response


def _same_origin(origin: str, host_header: str) -> bool:
    parts = urlsplit(origin)
    return (
        parts.scheme in ("http", "https")
        and bool(parts.netloc)
        and parts.netloc.lower() == host_header.lower()
    )


class Guard:
    """The guard of one proxy: its middleware, its application, its connection watch."""

    def __init__(self, settings: GuardSettings | None = None) -> None:
        self.settings = settings or GuardSettings()
        self.busy: set[Any] = set()  # connections (aiohttp request handlers) with a request in flight

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        """Checks Host and Origin and reads the body within its limits (handlers then read it from
        memory); marks the connection busy meanwhile."""
        settings = self.settings
        host = request.headers.get("Host", "")
        if not settings.allowed_host(host):
            return _refuse(403, f"Host {host!r} does not name this proxy (only {settings.host} does)")
        origin = request.headers.get("Origin")
        if origin is not None and not _same_origin(origin, host):
            return _refuse(403, f"requests from a web page ({origin!r}) are not taken")
        if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
            return _refuse(403, "requests from another site's web page are not taken")
        protocol = request.protocol
        self.busy.add(protocol)
        try:
            if request.method not in _IDEMPOTENT or request.body_exists:
                try:
                    await asyncio.wait_for(request.read(), settings.body_timeout_s)
                except asyncio.TimeoutError:
                    return _refuse(
                        408, f"the request body did not arrive within {settings.body_timeout_s:g} s"
                    )
                except web.HTTPRequestEntityTooLarge:
                    return _refuse(413, f"the request body is over {settings.max_body_bytes} bytes")
            return await handler(request)
        finally:
            self.busy.discard(protocol)

    def application(self, **kwargs: Any) -> web.Application:
        """A ``web.Application`` with the guard installed: its middleware, its body limit, the
        head timeout, and bounded logging."""
        settings = self.settings
        bounded_logging(settings.log_every_s)
        handler_args = {"keepalive_timeout": settings.header_timeout_s, **kwargs.pop("handler_args", {})}
        return web.Application(
            middlewares=[self.middleware, *kwargs.pop("middlewares", ())],
            client_max_size=settings.max_body_bytes,
            handler_args=handler_args,
            **kwargs,
        )

    async def watch(self, server: Any, every_s: float = 0.2) -> None:
        """Keep ``server``'s (an aiohttp ``web.Server``) open connections under the limit: beyond
        it, close the oldest that have no request in flight. Runs until cancelled."""
        limit = max(16, min(self.settings.max_connections, raise_file_limit() - 256))
        while True:
            await asyncio.sleep(every_s)
            connections = server.connections  # oldest first
            excess = len(connections) - limit
            for handler in connections:
                if excess <= 0:
                    break
                if handler not in self.busy:
                    handler.force_close()
                    excess -= 1


def raise_file_limit() -> int:
    """Raise this process's open-file limit to its hard limit; the soft limit now in force."""
    try:
        import resource
    except ImportError:  # not on this platform
        return 1 << 16
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


# ---- logs -------------------------------------------------------------------------------------------


class BoundedLog(logging.Filter):
    """One line per record, at most one of each kind every ``every_s`` seconds."""

    def __init__(self, every_s: float) -> None:
        super().__init__()
        self.every_s = every_s
        self._last: dict[tuple[str, Any], float] = {}
        self._held: dict[tuple[str, Any], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.msg if isinstance(record.msg, str) else type(record.msg))
        now = time.monotonic()
        if now - self._last.get(kind, -1e18) < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        if len(self._last) > 1024:
            self._last.clear()
            self._held.clear()
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        reason = ""
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            reason = f": {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        text = " ".join((record.getMessage() + reason).split())[:500]
        record.msg, record.args = text + (f" ({held} more like this held back)" if held else ""), None
        record.exc_info = record.exc_text = record.stack_info = None
        return True


_LOGGERS = ("aiohttp.server", "aiohttp.access", "aiohttp.web", "aiohttp.internal", "asyncio")


def bounded_logging(every_s: float) -> None:
    """Put a ``BoundedLog`` on aiohttp's and asyncio's loggers (once)."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, BoundedLog) for f in logger.filters):
            logger.addFilter(BoundedLog(every_s))


# ---- the upstream's credentials ---------------------------------------------------------------------


def upstream_credentials(url: str | None) -> tuple[str | None, str | None]:
    """``url`` without its user info, and the Basic ``Authorization`` value it held (else None)."""
    if url is None:
        return None, None
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        raise ProxyError("--upstream: the port is not a number from 0 to 65535") from None
    netloc = host + (f":{port}" if port is not None else "")
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)), f"Basic {token}"


def with_upstream_auth(headers: dict[str, str], authorization: str | None) -> dict[str, str]:
    """``headers`` for the upstream: the URL's credentials when the client sent no Authorization."""
    if authorization is None or any(name.lower() == "authorization" for name in headers):
        return headers
    return {**headers, "Authorization": authorization}
