"""The pages where a run is understood, driven in real Chromium: overview trends, step, group,
prompt history, trajectory; numbers checked against ``rlreplay ls/stats --json``."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from conftest import SHOWCASE, cli_json


def _get(url: str) -> str:
    with urllib.request.urlopen(url) as resp:
        return resp.read().decode()


def test_trajectory_duration_is_the_listings(ui_url, ui_runs: Path, tab) -> None:
    """The trainer's signals span, written minutes later, does not stretch the trajectory."""
    rows = cli_json("ls", str(ui_runs / SHOWCASE.name))
    row = max(rows, key=lambda r: r["duration_s"])
    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/t/{row['id']}")
    assert tab.inner_text("#duration") == f"{row['duration_s']:.3f} s"
    widths = [
        float(w.rstrip("%"))
        for w in tab.locator("#timeline .bar").evaluate_all("bs => bs.map(b => b.style.width)")
    ]
    assert max(widths) > 95  # the root span fills the timeline (not squashed by the signals span)


def test_no_live_badge_on_a_finished_run(ui_url, tab) -> None:
    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/")
    tab.wait_for_selector("#total")
    assert tab.locator("#live-dot").count() == 0


def test_no_absolute_path_in_pages(ui_url, ui_runs: Path) -> None:
    ids = [r["id"] for r in cli_json("ls", str(ui_runs / SHOWCASE.name))]
    base = f"{ui_url}/r/{SHOWCASE.name}"
    for path in ("/", f"/t/{ids[0]}", f"/group/{ids[0]}", f"/diff?a={ids[0]}&b={ids[1]}", "/findings"):
        body = _get(base + path)
        assert str(ui_runs) not in body, path
    assert str(ui_runs) not in _get(ui_url + "/")  # the folder of runs is named, not its path
