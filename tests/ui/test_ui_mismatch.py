"""The UI's trainer-vs-rollout views in real Chromium: the token overlay counts model tokens only
(tool and observation tokens greyed, never painted as mismatch) and its legend says what |Δ| is;
the mismatch page shows ``rlreplay mismatch --json``'s numbers and leads to the trajectories."""

from __future__ import annotations

import math
import re
from pathlib import Path

from mismatch_truth import responses
from ui_support import SHOWCASE, cli_json, screenshot

LEVELS = 20  # colour steps of an overlay
MISMATCH_FULL = 1.0  # |Δ| painted at full colour


def _with_tools(ui_runs: Path) -> tuple[str, dict]:
    """A training trajectory of the showcase with tool tokens in its response, and its truth."""
    truth = responses(ui_runs / SHOWCASE.name)
    tid = next(
        t
        for t, r in sorted(truth.items())
        if not r["validate"] and r["trainer"] is not None and not r["mask"].all()
    )
    return tid, truth[tid]


def test_the_overlay_greys_tool_tokens_and_paints_model_tokens_by_their_gap(
    ui_url, ui_runs: Path, tab
) -> None:
    tid, truth = _with_tools(ui_runs)
    row = next(r for r in cli_json("ls", str(ui_runs / SHOWCASE.name)) if r["id"] == tid)
    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/t/{tid}")
    tab.check("#overlay-switch input[value=mismatch]")
    tokens = tab.locator("#tokens .tk")
    assert tokens.count() == len(truth["ids"])
    classes = tokens.evaluate_all("ts => ts.map(t => t.className)")
    gaps = []
    for k, cls in enumerate(classes):
        level = [int(c[1:]) for c in cls.split() if re.fullmatch(r"b\d+", c)]
        if not truth["mask"][k]:  # a tool or observation token: no mismatch colour at all
            assert level == [] and "m0" in cls.split(), (k, cls)
            continue
        gap = abs(truth["trainer"][k] - truth["rollout"][k])
        gaps.append(gap)
        want = round(min(gap / MISMATCH_FULL, 1.0) * LEVELS)
        assert level == ([want] if want else []), (k, cls, gap)
    # what the overlay paints is what the page's header says: the largest gap of a model token
    assert math.isclose(max(gaps), row["logprob_diff_max"], rel_tol=1e-6)
    tool = next(k for k in range(len(classes)) if not truth["mask"][k])
    model = next(k for k in range(len(classes)) if truth["mask"][k])
    style = "e => getComputedStyle(e).color"
    assert tokens.nth(tool).evaluate(style) != tokens.nth(model).evaluate(style)  # greyed
    legend = tab.inner_text("#legend .lg-mismatch")
    assert "|Δ| = |trainer − rollout| log-prob" in legend and "tool" in legend
    tokens.nth(tool).hover()
    assert "not counted" in tab.inner_text("#tip")
    screenshot(tab, "mismatch-overlay", at="#tokens")
    assert tab.errors == []
