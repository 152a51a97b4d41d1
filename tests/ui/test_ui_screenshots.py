"""The README's screenshots, taken from the shipped showcase run (``RLREPLAY_WRITE_DOCS=1`` writes
them to ``docs/screenshots/``): overview, step, group, prompt history, trajectory. Each page is
checked against ``rlreplay ls --json`` before it is taken, so a picture shows the run's numbers."""

from __future__ import annotations

from ui_support import SHOWCASE, cli_json, screenshot


def _close(shown: str, value: float) -> bool:
    return abs(float(shown) - value) <= 1e-3 * max(1.0, abs(value))


def test_screenshots_of_the_showcase_run(ui_url, tab) -> None:
    rows = cli_json("ls", str(SHOWCASE))
    train = [r for r in rows if not r["validate"]]
    base = f"{ui_url}/r/{SHOWCASE.name}"

    tab.goto(f"{base}/")
    tab.wait_for_selector("#train-stats svg.chart")
    labels = tab.locator("#train-stats svg.chart").evaluate_all(
        "s => s.map(e => e.getAttribute('aria-label'))"
    )
    assert {"reward mean", "advantage spread (std)", "trainer vs rollout log-prob diff"} <= set(labels)
    assert tab.inner_text("#total") == str(len(rows))
    screenshot(tab, "overview")

    # the step with the most groups whose rollouts got different rewards
    def spread(step: int) -> int:
        groups: dict[int, set] = {}
        for r in train:
            if r["step"] == step:
                groups.setdefault(r["sample_index"], set()).add(r["reward"])
        return sum(len(v) > 1 for v in groups.values())

    step = max(sorted({r["step"] for r in train}), key=spread)
    members = [r for r in train if r["step"] == step]
    tab.goto(f"{base}/trajectories?step={step}&split=train")
    tab.wait_for_selector("#count")
    assert tab.inner_text("#count") == str(len(members))
    screenshot(tab, "step")

    sample = max(
        sorted({r["sample_index"] for r in members}),
        key=lambda s: len({r["reward"] for r in members if r["sample_index"] == s}),
    )
    group = {r["id"]: r for r in members if r["sample_index"] == sample}
    tab.click(f"#groups tr[data-sample='{sample}'] a.group-link")
    tab.wait_for_selector("#group")
    for head in tab.locator("#group .rollout").all():
        tid = head.locator("a.traj-link").get_attribute("href").rsplit("/", 1)[1]
        assert _close(head.locator(".reward").inner_text(), group[tid]["reward"])
    assert "diverges at turn" in tab.inner_text("#group")
    screenshot(tab, "group")

    tab.click("#prompt-link")
    tab.wait_for_selector("#history")
    steps = sorted({r["step"] for r in train if r["sample_index"] == sample})
    assert len(steps) >= 3  # the showcase's prompts recur
    assert tab.locator("section.pstep").count() == len(steps)
    screenshot(tab, "prompt-history")

    best = max(group.values(), key=lambda r: (r["reward"], r["advantage"]))
    tab.goto(f"{base}/t/{best['id']}")
    tab.wait_for_selector("#tokens")
    tab.check("#overlay-switch input[value=mismatch]")
    assert tab.locator("#legend .lg-mismatch").is_visible()
    screenshot(tab, "trajectory", at="#timeline")
    assert tab.errors == []
