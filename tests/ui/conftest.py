"""Session fixtures of the UI page tests: one folder of runs, one app server, one Chromium.

The folder holds a copy of ``SHOWCASE`` (the verl run the pages are shown on) and ``trend``, a
synthetic run recorded with the real recorder (recurring prompts over six steps, trainer signals
with per-token log-probs).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ui_support import CHROMIUM, SHOWCASE, TESTS, TREND, serving


@pytest.fixture(scope="session")
def ui_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ui-pages") / "runs"
    root.mkdir()
    shutil.copytree(SHOWCASE, root / SHOWCASE.name)
    job = [sys.executable, str(TESTS / "ui_record_job.py"), "trend", str(root / TREND)]
    subprocess.run(job, check=True, timeout=180)
    return root


@pytest.fixture(scope="session")
def ui_url(ui_runs: Path) -> Iterator[str]:
    from rlreplay.ui.app import create_app

    with serving(create_app(ui_runs, poll_ms=60_000, allowed_hosts=["127.0.0.1"])) as url:
        yield url


@pytest.fixture(scope="module")  # Playwright's sync API holds an event loop while open
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
