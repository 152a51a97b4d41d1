"""The pages on a large synthetic run (30 steps x 256 trajectories, built from the sample run's step
5 in this session), driven in real Chromium: overview, paging, sorting, the step page, prompt
history; numbers checked against the span files read with pyarrow and ``rlreplay ls/stats --json``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import synthetic_run
from ui_support import REPO, cli_json, serving

STEPS, PER_STEP = 30, 256
BIG = "big"


@pytest.fixture(scope="module")
def big_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlreplay.read.open import open_run

    root = tmp_path_factory.mktemp("ui-large") / "runs"
    base = open_run(REPO / "sample_runs" / "gsm8k-grpo-qwen3").spans(step=5)
    synthetic_run.build_run(root / BIG, base, STEPS, PER_STEP, seed=7)
    return root / BIG


@pytest.fixture(scope="module")
def big_url(big_run: Path) -> Iterator[str]:
    from rlreplay.ui.app import create_app

    with serving(create_app(big_run.parent, poll_ms=60_000, allowed_hosts=["127.0.0.1"])) as url:
        yield f"{url}/r/{BIG}"


@pytest.fixture(scope="module")
def truth(big_run: Path) -> list[dict[str, Any]]:
    """One row per trajectory, straight from the span files: id, step, sample, rollout, reward."""
    files = sorted((big_run / "spans").rglob("*.parquet"))
    columns = ["trajectory_id", "step", "sample_index", "rollout_n", "validate", "reward"]
    spans = pa.concat_tables(pq.read_table(f, columns=columns) for f in files)
    rows = spans.group_by("trajectory_id").aggregate(
        [
            ("step", "max"),
            ("sample_index", "max"),
            ("rollout_n", "max"),
            ("validate", "max"),
            ("reward", "max"),
        ]
    )
    return [
        {
            "id": r["trajectory_id"],
            "step": r["step_max"],
            "sample_index": r["sample_index_max"],
            "rollout_n": r["rollout_n_max"],
            "validate": r["validate_max"],
            "reward": r["reward_max"],
        }
        for r in rows.to_pylist()
    ]


def _numbers(texts: list[str]) -> list[float]:
    return [float(t) for t in texts]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 5e-4 * max(1.0, abs(y)) for x, y in zip(a, b))


def test_the_run_is_as_built(big_run: Path, truth: list[dict[str, Any]]) -> None:
    """The builder's run, as ``ls`` reads it: every trajectory of every step, one reward each."""
    assert len(truth) == STEPS * PER_STEP
    listed = {r["id"]: r for r in cli_json("ls", str(big_run))}
    assert set(listed) == {r["id"] for r in truth}
    for r in truth[:: PER_STEP // 4]:
        assert listed[r["id"]]["reward"] == pytest.approx(r["reward"])
        assert (listed[r["id"]]["step"], listed[r["id"]]["sample_index"]) == (r["step"], r["sample_index"])


def test_overview_counts_and_step_rewards(
    big_url: str, big_run: Path, truth: list[dict[str, Any]], tab
) -> None:
    tab.goto(f"{big_url}/")
    assert tab.inner_text("#total") == str(len(truth))
    stats = [r for r in cli_json("stats", str(big_run)) if not r["validate"]]
    assert [r["step"] for r in stats] == list(range(STEPS))
    for row in stats:
        shown = tab.locator(f"#train-stats tr[data-step='{row['step']}'] td.reward-mean").inner_text()
        rewards = [t["reward"] for t in truth if t["step"] == row["step"]]
        assert abs(float(shown) - sum(rewards) / len(rewards)) <= 5e-4
        assert abs(float(shown) - row["reward_mean"]) <= 5e-4
    assert tab.errors == []


def test_paging_and_sorting_by_a_header(big_url: str, truth: list[dict[str, Any]], tab) -> None:
    rewards = sorted(t["reward"] for t in truth)
    tab.goto(f"{big_url}/trajectories?{urlencode({'per': 100})}")
    assert tab.inner_text("#count") == str(len(truth))
    pages = -(-len(truth) // 100)
    assert f"page 1 of {pages}" in tab.inner_text("p.count")
    reward_col = None

    def shown_rewards() -> list[float]:
        nonlocal reward_col
        heads = tab.locator("table.list tr").first.locator("th").all_inner_texts()
        reward_col = next(i for i, h in enumerate(heads) if h.split()[:1] == ["reward"])
        cells = tab.locator(f"table.list tr td:nth-child({reward_col + 1})").all_inner_texts()
        return _numbers(cells)

    tab.click("table.list a.sort[data-col=reward]")  # ascending
    tab.wait_for_url("**sort=reward*")
    assert _close(shown_rewards(), rewards[:100])
    tab.click("table.list a.sort[data-col=reward]")  # then descending
    tab.wait_for_url("**sort=reward+desc*")
    assert _close(shown_rewards(), rewards[::-1][:100])
    tab.click("nav.pages a[rel=next]")
    tab.wait_for_url("**page=2*")
    assert _close(shown_rewards(), rewards[::-1][100:200])
    assert f"page 2 of {pages}" in tab.inner_text("p.count")
    last = tab.url.replace("page=2", f"page={pages}")
    tab.goto(last)
    assert _close(shown_rewards(), rewards[::-1][(pages - 1) * 100 :])
    assert tab.locator("nav.pages a[rel=next]").count() == 0
    assert tab.errors == []


def test_step_page_groups_and_prompt_history(big_url: str, truth: list[dict[str, Any]], tab) -> None:
    step = 17
    at_step = [t for t in truth if t["step"] == step and not t["validate"]]
    tab.goto(f"{big_url}/trajectories?{urlencode({'step': step, 'split': 'train'})}")
    tab.wait_for_selector("#groups")
    assert tab.inner_text("#step-stats [data-stat=trajectories]") == str(len(at_step))
    mean = sum(t["reward"] for t in at_step) / len(at_step)
    assert abs(float(tab.inner_text("#step-stats [data-stat=reward_mean]")) - mean) <= 5e-4
    samples = sorted({t["sample_index"] for t in at_step})
    assert tab.locator("#groups tr[data-sample]").count() == len(samples)
    sample = samples[len(samples) // 2]
    group = [t["reward"] for t in at_step if t["sample_index"] == sample]
    row = tab.locator(f"#groups tr[data-sample='{sample}']")
    assert abs(float(row.locator("td.reward-mean").inner_text()) - sum(group) / len(group)) <= 5e-4

    # keyboard: the next step
    tab.keyboard.press("j")
    tab.wait_for_url(f"**step={step + 1}*")
    tab.go_back()
    tab.wait_for_selector("#groups")

    # this prompt across training: its rollouts at every step, with their rewards
    tab.locator(f"#groups tr[data-sample='{sample}'] a.prompt-link").click()
    tab.wait_for_selector("#history")
    mine = [t for t in truth if t["sample_index"] == sample and not t["validate"]]
    seen: list[int] = []
    while True:  # the history's pages, latest steps first, each with its rollouts' rewards
        steps_here = tab.locator("#history section.pstep").evaluate_all(
            "ss => ss.map(s => Number(s.dataset.step))"
        )
        seen += steps_here
        for s in set(steps_here) & {0, step, STEPS - 1}:
            section = tab.locator(f"#history section[data-step='{s}']")
            by_id = {t["id"]: t["reward"] for t in mine if t["step"] == s}
            ids = section.locator("tr[data-id]").evaluate_all("rs => rs.map(r => r.dataset.id)")
            assert set(ids) == set(by_id)
            shown = _numbers(section.locator("td.reward").all_inner_texts())
            assert _close(shown, [by_id[i] for i in ids])
        if tab.locator("#older").count() == 0:
            break
        with tab.expect_navigation():
            tab.click("#older")
    assert sorted(seen) == list(range(STEPS)) and len(seen) == STEPS
    assert tab.errors == []
