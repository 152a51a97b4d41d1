"""What the trajectory and findings pages show, in real Chromium at 1,280 px: an answer cut by its
length limit is marked in the chat, and the findings page fits the window with its text whole.
Expected values come from the span files (each model call's ``stop_reason``) and ``ls --json``."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlencode

from support import length_stops
from ui_support import SHOWCASE, cli_json

WIDTH = 1280  # the tab fixture's window


def test_chat_marks_an_answer_cut_by_its_length_limit(ui_url, ui_runs: Path, tab) -> None:
    stops = length_stops(ui_runs / SHOWCASE.name)
    truncated = [t for t, calls in stops.items() if any(calls)]
    clean = next(t for t, calls in stops.items() if calls and not any(calls))
    assert truncated
    for traj_id in (truncated[0], clean):
        tab.goto(f"{ui_url}/r/{SHOWCASE.name}/t/{traj_id}")
        tab.wait_for_selector("#chat")
        bubbles = tab.locator("#chat .bubble.assistant").all()
        assert [b.locator(".stopped").count() == 1 for b in bubbles] == stops[traj_id], traj_id
        for bubble, cut in zip(bubbles, stops[traj_id]):
            if cut:
                assert "length" in bubble.locator(".role").inner_text()
    assert tab.errors == []


def test_findings_page_fits_1280_px_with_its_text_whole(ui_url, tab) -> None:
    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/findings")
    tab.wait_for_selector("#finding-counts")
    assert tab.evaluate("document.documentElement.scrollWidth") <= WIDTH
    # every cell's text is inside the window and none is cut (a cell as wide as its text)
    cells = tab.locator("#finding-counts td, #finding-list td").evaluate_all(
        "cs => cs.map(c => [c.getBoundingClientRect().right, c.scrollWidth - c.clientWidth])"
    )
    assert cells and all(right <= WIDTH and hidden <= 0 for right, hidden in cells), cells[:5]
    flags = tab.locator("#finding-counts td:nth-child(3)").all_inner_texts()
    assert any(len(text) > 100 for text in flags)  # the long descriptions are there, whole
    shown = {r["id"] for r in cli_json("ls", str(SHOWCASE))}
    links = tab.locator("#finding-list a").evaluate_all("as => as.map(a => a.href.split('/t/')[1])")
    assert set(links) <= shown


def test_search_box_lists_the_trajectories_whose_text_matches(ui_url, ui_runs: Path, tab) -> None:
    from support import grep_truth, searched_texts

    run = ui_runs / SHOWCASE.name
    texts = searched_texts(run, run / "tokenizer.json")
    pattern = next(
        p for p in (r"#### 1\d$", r"#### \d+$", "tool_call") if 0 < len(grep_truth(texts, p)) < len(texts)
    )
    expected = grep_truth(texts, pattern)
    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/trajectories?per=500")
    tab.fill("#search", pattern)
    with tab.expect_navigation():
        tab.click("#filters button[type=submit]")
    tab.wait_for_selector("#count")
    assert tab.inner_text("#count") == str(len(expected))
    shown = tab.locator("#listing a.traj-link").evaluate_all(
        "as => as.map(a => a.href.split('/t/')[1].split('?')[0])"
    )
    assert set(shown) == expected
    assert tab.input_value("#search") == pattern  # the box keeps what was searched
    # with another filter of the form, and a bad pattern said in one line
    query = urlencode({"per": 500, "validate": "false", "grep": pattern})
    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/trajectories?{query}")
    train = {r["id"] for r in cli_json("ls", str(run), "--train")}
    assert tab.inner_text("#count") == str(len(expected & train))
    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/trajectories?grep=%5Ba")
    assert "--grep" in tab.inner_text("#error")
    assert tab.errors == []
