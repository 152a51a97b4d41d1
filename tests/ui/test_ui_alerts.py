"""The front page's alerts (real headless Chromium): what ``rlreplay watch`` alerts on appears beside
the trends as the run's steps arrive, each alert linking to the trajectories behind it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ui_support import serving
from watch_live import JOB, faulty_ids

STEPS = 5
FAULT_STEP = 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The generic job with a fault from FAULT_STEP, recorded whole."""
    base = tmp_path_factory.mktemp("ui-alerts")
    control = base / "control"
    control.mkdir()
    (control / "stop").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLREPLAY_")}
    job = [sys.executable, str(JOB), str(STEPS), str(FAULT_STEP), str(control)]
    subprocess.run(
        [sys.executable, "-m", "rlreplay", "record", "--out", str(base / "run"), "--", *job],
        env=env,
        check=True,
        capture_output=True,
        timeout=180,
    )
    return base / "run", control


def test_alerts_appear_live_and_link_to_the_faulty_trajectories(recorded, tab, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    from rlreplay.ui.app import create_app

    run, control = recorded
    root = tmp_path / "runs"
    shown = root / "faulty"
    shutil.copytree(run, shown, ignore=shutil.ignore_patterns("step=3", "step=4", "_run_index"))
    later = tmp_path / "later"
    for step in (FAULT_STEP, FAULT_STEP + 1):
        shutil.copytree(run / "spans" / f"step={step}", later / f"step={step}")
    bad = {i for i, is_bad in faulty_ids(control)[FAULT_STEP].items() if is_bad}
    page = tab
    with serving(create_app(root, poll_ms=300, allowed_hosts=["127.0.0.1"])) as url:
        page.goto(f"{url}/r/faulty/")
        expect(page.locator("#alerts #no-alerts")).to_be_visible()  # healthy steps: no alert
        for step in (FAULT_STEP, FAULT_STEP + 1):  # the next steps land, as a recorder seals them
            os.rename(later / f"step={step}", shown / "spans" / f"step={step}")
        rows = page.locator("#alert-list tr.alert-row")
        expect(rows.first).to_be_visible()  # without reloading the page
        checks = {r.get_attribute("data-check") for r in rows.all() if r.get_attribute("data-step") == "3"}
        assert {"repetition", "tool_error"} <= checks
        tool = page.locator('#alert-list tr.alert-row[data-check="tool_error"]')
        linked = {a.get_attribute("href").rsplit("/", 1)[1] for a in tool.locator("a.alert-traj").all()}
        assert linked == bad  # each faulty rollout linked, no healthy one
        tool.locator("a.alert-list-link").click()  # the list of the trajectories behind the alert
        page.wait_for_selector("table")
        listed = {href.split("?")[0].rsplit("/", 1)[1] for href in _hrefs(page) if "/t/" in href}
        assert listed == bad
    assert page.errors == []


def _hrefs(page) -> list[str]:
    return json.loads(page.evaluate("JSON.stringify([...document.querySelectorAll('a')].map(a => a.href))"))
