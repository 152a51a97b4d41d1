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


def _close(shown: str, value: float) -> bool:
    return abs(float(shown) - value) <= 1e-3 * max(1.0, abs(value))


VERL_SHOWN = (
    "kl",
    "k3_kl",
    "chi2_token",
    "chi2_seq",
    "training_ppl",
    "rollout_ppl",
    "log_ppl_diff",
    "ppl_ratio",
)
GAP_SHOWN = (
    "logprob_diff_mean",
    "logprob_diff_p99",
    "logprob_diff_max",
    "seq_logprob_diff_max_p50",
    "seq_logprob_diff_max_p90",
    "token_mult_prob_error",
    "tis_token_frac_high",
    "icepop_token_frac_out",
    "tis_seq_frac_high",
    "eff_sample_size",
)


def test_the_mismatch_page_shows_the_commands_numbers(ui_url, ui_runs: Path, tab) -> None:
    run = str(ui_runs / SHOWCASE.name)
    rows = cli_json("mismatch", run)
    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/")
    tab.click("#mismatch-link")  # reachable from the overview
    tab.wait_for_selector("#mismatch-verl")
    assert tab.evaluate("document.documentElement.scrollWidth") <= 1280  # fits the window
    for row in rows:
        split = "val" if row["validate"] else "train"
        for table, names in (("#mismatch-verl", VERL_SHOWN), ("#mismatch-gap", GAP_SHOWN)):
            cells = tab.locator(f"{table} tr[data-step='{row['step']}'][data-split='{split}']")
            for name in names:
                assert _close(cells.locator(f"td[data-metric={name}]").inner_text(), row[name]), (name, row)
        verdict = tab.locator(f"#mismatch-gap tr[data-step='{row['step']}'] td[data-metric=verdict]")
        assert verdict.inner_text() == row["verdict"]
    screenshot(tab, "mismatch")

    # buckets: the command's --by, bucket by bucket
    tab.click("nav.by >> text=probability")
    tab.wait_for_selector("#mismatch-buckets")
    buckets = cli_json("mismatch", run, "--by", "probability")
    shown = tab.locator("#mismatch-buckets tr[data-bucket]")
    assert shown.count() == len(buckets)
    for bucket in buckets:
        cells = tab.locator(f"#mismatch-buckets tr[data-bucket='{bucket['bucket']}']")
        assert cells.locator("td[data-metric=tokens]").inner_text() == str(bucket["tokens"])
        for name in ("logprob_diff_mean", "token_mult_prob_error", "kl"):
            text = cells.locator(f"td[data-metric={name}]").inner_text()
            assert (text == "–") if bucket[name] is None else _close(text, bucket[name]), (name, bucket)
    assert tab.errors == []


def test_the_worst_token_leads_to_it_in_the_trajectory(ui_url, ui_runs: Path, tab) -> None:
    truth = responses(ui_runs / SHOWCASE.name)
    worst = max(
        (abs(r["trainer"][k] - r["rollout"][k]), tid, k)
        for tid, r in truth.items()
        if r["trainer"] is not None
        for k in range(len(r["ids"]))
        if r["mask"][k]
    )
    gap, tid, position = worst
    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/mismatch")
    first = tab.locator("#worst-tokens tr:has(a.token-link)").first
    assert _close(first.locator("td[data-metric=logprob_diff]").inner_text(), gap)
    assert first.locator("td[data-metric=position]").inner_text() == str(position)
    first.locator("a.token-link").click()
    tab.wait_for_selector("#tokens .tk.at")
    assert tid in tab.url
    assert tab.locator("#overlay-switch input[value=mismatch]").is_checked()
    index = tab.locator("#tokens .tk").evaluate_all("ts => ts.findIndex(t => t.classList.contains('at'))")
    assert index == position
    tab.locator("#tokens .tk.at").hover()
    assert f"|Δ| {gap:.4f}" in tab.inner_text("#tip")
    assert tab.errors == []


def test_a_run_without_trainer_log_probs_per_token_shows_the_per_rollout_figures(
    tmp_path: Path, chrome
) -> None:
    import shutil

    from ui_support import serving

    from rlreplay.ui.app import create_app

    run = SHOWCASE.parent / "verl-toolagent-smollm2"  # recorded without --token-signals
    bare = SHOWCASE.parent / "gsm8k-grpo-qwen3"  # no trainer figure at all
    for source in (run, bare):
        shutil.copytree(source, tmp_path / source.name)
    page = chrome.new_page()
    with serving(create_app(tmp_path, allowed_hosts=["127.0.0.1"])) as url:
        page.goto(f"{url}/r/{run.name}/mismatch")
        said = page.inner_text("#per-rollout")
        summary = page.inner_text("#mismatch-summary")
        shown = {
            int(row.get_attribute("data-step")): row.locator("[data-metric=logprob_diff_max]").inner_text()
            for row in page.locator("#mismatch-rollouts tr[data-step]").all()
        }
        page.goto(f"{url}/r/{bare.name}/mismatch")
        nothing = page.inner_text("#no-mismatch")
    page.close()
    assert "--token-signals" in said and "Per rollout, not per token" in summary
    want = {r["step"]: r["logprob_diff_max"] for r in cli_json("mismatch", str(run)) if not r["validate"]}
    assert set(shown) == set(want)
    for step, text in shown.items():
        assert math.isclose(float(text), want[step], rel_tol=1e-3), (step, text)
    assert "nothing to compare" in nothing and "--token-signals" in nothing
