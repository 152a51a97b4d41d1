"""Helpers of the UI tests: the runs shown, the app on a free port, the CLI's `--json` rows, screenshots."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TESTS = Path(__file__).parents[1]
REPO = TESTS.parent
#: The shipped verl run the page tests drive and the README's screenshots show.
SHOWCASE = REPO / "sample_runs" / "verl-arith-smollm2"
TREND = "trend"
CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = REPO / "docs" / "screenshots"


def cli_json(*args: str) -> list[dict[str, Any]]:
    """The rows ``rlreplay ARGS --json`` prints (JSON lines), run as the user runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "rlreplay", *args, "--json"], check=True, capture_output=True, text=True
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """The app served by uvicorn in a thread on a free loopback port; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the app server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()


def screenshot(page: Any, name: str, at: str | None = None) -> None:
    """With ``RLREPLAY_WRITE_DOCS=1``: what the window shows as ``docs/screenshots/NAME.png`` (for
    the README), of a page of a run that ships in ``sample_runs/``; ``at``: scrolled to this element
    first."""
    if not os.environ.get("RLREPLAY_WRITE_DOCS"):
        return
    from urllib.parse import urlsplit

    from PIL import Image

    shown = urlsplit(page.url).path.split("/")  # /r/RUN/...
    assert shown[1] == "r" and (REPO / "sample_runs" / shown[2] / "run.json").is_file(), page.url

    if at is not None:
        page.locator(at).evaluate("e => e.scrollIntoView({block: 'start'})")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    dest = SCREENSHOTS / f"{name}.png"
    raw = dest.with_suffix(".raw.png")
    page.screenshot(path=str(raw), clip={"x": 0, "y": 0, "width": 1280, "height": 800})
    Image.open(raw).convert("RGB").quantize(colors=96).save(dest, optimize=True)
    raw.unlink()
