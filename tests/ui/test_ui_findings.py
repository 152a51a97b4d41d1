"""The audit's findings in ``rlreplay ui`` (real headless Chromium): the findings page counts
what the checks flag in the shipped real-verl run, and a flagged trajectory wears a badge."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from audit_truth import verl_sample_truth
from ui_support import serving

VERL = Path(__file__).parents[2] / "sample_runs" / "verl-toolagent-smollm2"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from rlreplay.ui.app import create_app

    root = tmp_path_factory.mktemp("ui-findings") / "runs"
    root.mkdir()
    shutil.copytree(VERL, root / VERL.name)
    with serving(create_app(root, poll_ms=60_000, allowed_hosts=["127.0.0.1"])) as url:
        yield f"{url}/r/{VERL.name}"


@pytest.fixture
def page(tab):
    return tab


def test_findings_page_and_badges(server: str, page) -> None:
    truth = verl_sample_truth(VERL)
    page.goto(f"{server}/")
    page.click("header >> text=findings")
    counts = {
        row.locator("td").nth(0).inner_text(): row.locator("td").nth(1).inner_text()
        for row in page.locator("#finding-counts tr").all()[1:]
    }
    for check, flagged in truth.items():
        assert counts[check] == str(len(flagged)), (check, counts)
    listed = page.locator("#finding-list tr").all()[1:]
    tool_rows = [r for r in listed if r.locator("td").nth(0).inner_text() == "tool_error"]
    assert len(tool_rows) == len(truth["tool_error"])
    # a flagged trajectory: from the list to its page, which wears the badge
    tool_rows[0].locator("a").click()
    page.wait_for_selector("h1 .badge.finding")
    badges = page.locator("h1 .badge.finding").all_inner_texts()
    traj_id = page.locator("h1 code").inner_text()
    assert traj_id in truth["tool_error"] and "tool_error" in badges
    assert "error" in page.locator("#findings").inner_text()
    # a clean trajectory wears none: one the truth flags for nothing, in a group that did not collapse
    from rlreplay.read.open import open_run

    listing = open_run(VERL).trajectories().to_pylist()
    flagged = truth["tool_error"] | truth["truncated"] | truth["retokenization"]
    clean = next(
        r["id"]
        for r in listing
        if r["id"] not in flagged
        and (r["validate"] or (r["step"], r["sample_index"]) not in truth["group_collapse"])
    )
    page.goto(f"{server}/t/{clean}")
    page.wait_for_selector("h1 code")
    assert page.locator("h1 .badge.finding").count() == 0
