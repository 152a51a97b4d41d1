"""Session fixtures of the UI page tests: one folder of runs, one app server, one Chromium.

The folder holds a copy of ``SHOWCASE`` (the verl run the pages are shown on) and ``trend``, a
synthetic run recorded with the real recorder (recurring prompts over six steps, trainer signals
with per-token log-probs).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).parents[1]
REPO = TESTS.parent


def _suite_conftest() -> Any:
    """tests/conftest.py under its own name: test modules import its helpers as ``conftest``, a
    name this file holds once tests/ui is collected, so it passes them on."""
    spec = importlib.util.spec_from_file_location("rlreplay_suite_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_suite = _suite_conftest()
qwen_tokenizer_dir = _suite.qwen_tokenizer_dir
_free_port = _suite._free_port
EXPERIMENT, TRAIN_STEPS, TRAIN_SAMPLES, ROLLOUTS = (
    _suite.EXPERIMENT,
    _suite.TRAIN_STEPS,
    _suite.TRAIN_SAMPLES,
    _suite.ROLLOUTS,
)
VAL_STEPS, VAL_SAMPLES, VAL_ROLLOUTS = _suite.VAL_STEPS, _suite.VAL_SAMPLES, _suite.VAL_ROLLOUTS
#: The run the page tests drive (switch to the showcase verl run when it lands).
SHOWCASE = REPO / "sample_runs" / "verl-toolagent-smollm2"
TREND = "trend"
CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = REPO / "docs" / "screenshots"


def cli_json(*args: str) -> list[dict[str, Any]]:
    """The rows ``rlreplay ARGS --json`` prints (JSON lines), run as the user runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "rlreplay", *args, "--json"], check=True, capture_output=True, text=True
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="session")
def ui_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ui-pages") / "runs"
    root.mkdir()
    shutil.copytree(SHOWCASE, root / SHOWCASE.name)
    job = [sys.executable, str(TESTS / "ui_record_job.py"), "trend", str(root / TREND)]
    subprocess.run(job, check=True, timeout=180)
    return root


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


@pytest.fixture(scope="session")
def ui_url(ui_runs: Path) -> Iterator[str]:
    from rlreplay.ui.app import create_app

    with serving(create_app(ui_runs, poll_ms=60_000, allowed_hosts=["127.0.0.1"])) as url:
        yield url


@pytest.fixture(scope="session")
def chrome() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "the UI is tested in Debian's chromium: apt-get install chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def tab(chrome: Any) -> Iterator[Any]:
    """A fresh 1,280 px wide page; page errors are collected in ``tab.errors``."""
    context = chrome.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.errors = errors  # type: ignore[attr-defined]
    yield pg
    context.close()


def screenshot(page: Any, name: str, at: str | None = None) -> None:
    """With ``RLREPLAY_SCREENSHOTS=1``: what the window shows as ``docs/screenshots/NAME.png`` (for
    the README); ``at``: scrolled to this element first."""
    if not os.environ.get("RLREPLAY_SCREENSHOTS"):
        return
    from PIL import Image

    if at is not None:
        page.locator(at).evaluate("e => e.scrollIntoView({block: 'start'})")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    dest = SCREENSHOTS / f"{name}.png"
    raw = dest.with_suffix(".raw.png")
    page.screenshot(path=str(raw), clip={"x": 0, "y": 0, "width": 1280, "height": 800})
    Image.open(raw).convert("RGB").quantize(colors=96).save(dest, optimize=True)
    raw.unlink()
