"""The pages on a large synthetic run (30 steps x 256 trajectories, built from the sample run's step
5 in this session, each step's first prompts planted as collapsed groups and a few trajectories
with a far importance ratio), driven in real Chromium:
overview, paging, sorting, filtering, the step page, prompt history, the drill-down to a token,
findings, and the comparison with a copy whose token ids were changed in a few trajectories;
numbers checked against the span files read with pyarrow and ``rlreplay ls/stats/audit/compare
--json``."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import synthetic_run
from ui_support import REPO, cli_json, serving

STEPS, PER_STEP = 30, 256
BIG, TWIN = "big", "big-twin"
COLLAPSE = 2  # prompts per step whose rollouts all get one reward
OUTLIERS = 3  # trajectories per step with a far importance ratio (trainer signals)
CHANGED_STEP, CHANGE_EVERY, ROLLOUTS = 3, 16, 4  # the twin: token ids changed here


@pytest.fixture(scope="module")
def big_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlreplay.read.open import open_run

    root = tmp_path_factory.mktemp("ui-large") / "runs"
    base = open_run(REPO / "sample_runs" / "gsm8k-grpo-qwen3").spans(step=5)
    synthetic_run.build_run(root / BIG, base, STEPS, PER_STEP, seed=7, collapse=COLLAPSE, outliers=OUTLIERS)
    return root / BIG


@pytest.fixture(scope="module")
def twin_changed(big_run: Path) -> set[str]:
    """A copy of the run next to it whose step CHANGED_STEP has one token id changed in every
    CHANGE_EVERY-th trajectory; the ids of the trajectories whose stored tokens differ."""
    from rlreplay.shards.seal import write_sealed

    twin = big_run.parent / TWIN
    shutil.copytree(big_run, twin)
    changed: set[str] = set()
    for f in sorted((twin / "spans").rglob("*.parquet")):
        table = pq.read_table(f)
        if pc.all(pc.not_equal(table["step"], CHANGED_STEP)).as_py():
            continue
        planted, _ = synthetic_run.plant_token_change(table, CHANGE_EVERY, ROLLOUTS)
        differs = pc.invert(
            pc.equal(pc.list_flatten(table["token_ids"]), pc.list_flatten(planted["token_ids"]))
        )
        rows = pc.list_parent_indices(table["token_ids"]).to_numpy()[differs.to_numpy(zero_copy_only=False)]
        changed |= set(pc.take(table["trajectory_id"], pa.array(rows)).to_pylist())
        f.unlink()
        write_sealed(planted, f)
    return changed


@pytest.fixture(scope="module")
def big_url(big_run: Path, twin_changed: set[str]) -> Iterator[str]:
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


def test_filtering_with_the_where_box(big_url: str, big_run: Path, truth: list[dict[str, Any]], tab) -> None:
    where = "reward > 0.9 and step >= 20"
    wanted = {t["id"] for t in truth if t["reward"] > 0.9 and t["step"] >= 20}
    assert 0 < len(wanted) <= 500  # one page of 500
    tab.goto(f"{big_url}/trajectories?{urlencode({'per': 500})}")
    tab.fill("input[name=where]", where)
    with tab.expect_navigation():
        tab.click("#filters button[type=submit]")
    assert tab.inner_text("#count") == str(len(wanted))
    hrefs = tab.locator("table.list a.traj-link").evaluate_all("ls => ls.map(l => l.getAttribute('href'))")
    shown = [h.split("/t/")[1].split("?")[0] for h in hrefs]
    assert len(shown) == len(wanted) and set(shown) == wanted
    listed = cli_json("ls", str(big_run), "--where", where)
    assert {r["id"] for r in listed} == wanted
    tab.fill("input[name=where]", "reward >")  # bad grammar: one line saying so, no rows
    with tab.expect_navigation():
        tab.click("#filters button[type=submit]")
    assert tab.locator("#error").count() == 1
    assert tab.errors == []


def _span(spans: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The first span of ``kind`` in a ``show --json`` span tree, depth first."""
    for span in spans:
        if span["kind"] == kind:
            return span
        with contextlib.suppress(StopIteration):
            return _span(span.get("children") or [], kind)
    raise StopIteration(kind)


def test_drill_down_from_an_overview_point_to_a_token(
    big_url: str, big_run: Path, truth: list[dict[str, Any]], tab
) -> None:
    step = 22
    tab.goto(f"{big_url}/")
    tab.locator(
        f"#train-stats svg.chart[aria-label='reward mean'] a.point:has(rect[data-step='{step}'])"
    ).click()
    tab.wait_for_selector("#groups")
    assert f"step={step}" in tab.url
    at_step = {t["id"] for t in truth if t["step"] == step and not t["validate"]}
    assert tab.inner_text("#step-stats [data-stat=trajectories]") == str(len(at_step))
    link = tab.locator("table.list a.traj-link").nth(5)
    tid = link.get_attribute("href").split("/t/")[1].split("?")[0]
    assert tid in at_step
    link.click()
    tab.wait_for_selector("#tokens .tk")

    # the recorded response, as ``show --json`` prints it: the agent span's ids and log-probs
    show = [sys.executable, "-m", "rlreplay", "show", str(big_run), tid, "--no-text", "--json"]
    shown = json.loads(subprocess.run(show, check=True, capture_output=True, text=True).stdout)
    agent = _span(shown["spans"], "agent")["output"]
    ids, logprobs = agent["response_ids"], agent["response_logprobs"]
    tokens = tab.locator("#tokens .tk")
    assert tokens.count() == len(ids) == len(logprobs)
    for k in (0, len(ids) // 2, len(ids) - 1):
        tokens.nth(k).hover()
        tip = tab.inner_text("#tip")
        assert f"#{k} id {ids[k]}" in tip and f"logprob {logprobs[k]:.4f}" in tip, tip
    assert tab.errors == []


def test_findings_page_counts_and_group_badges(
    big_url: str, big_run: Path, truth: list[dict[str, Any]], tab
) -> None:
    # ``rlreplay audit --json`` as the user runs it (meanwhile the page is read)
    job = [sys.executable, "-m", "rlreplay", "audit", str(big_run), "--json"]
    proc = subprocess.Popen(job, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tab.goto(f"{big_url}/")
    tab.click("header >> text=findings")
    tab.wait_for_selector("#finding-counts")
    assert f" {len(truth)} trajectories" in tab.inner_text("main p")
    counts = {
        row.locator("td").nth(0).inner_text(): row.locator("td").nth(1).inner_text()
        for row in tab.locator("#finding-counts tr").all()[1:]
    }
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err  # 1: a trajectory-level check (mismatch) found something
    audit = [json.loads(line) for line in out.splitlines() if line.strip()]
    skipped = set(re.findall(r"note: (\w+) skipped", err))
    per_check: dict[str, int] = {}
    for f in audit:
        per_check[f["check"]] = per_check.get(f["check"], 0) + 1
    # what was planted: each step's COLLAPSE lowest prompts, every rollout with one reward
    planted = set()
    for step in range(STEPS):
        samples = sorted({t["sample_index"] for t in truth if t["step"] == step})[:COLLAPSE]
        for s in samples:
            assert len({t["reward"] for t in truth if (t["step"], t["sample_index"]) == (step, s)}) == 1
            planted.add((step, s))
    collapsed = {(f["step"], f["sample_index"]) for f in audit if f["check"] == "group_collapse"}
    assert collapsed == planted and per_check["group_collapse"] == STEPS * COLLAPSE

    for check, n in counts.items():  # garbled needs the tokenizer, which this run does not name
        if check in skipped:
            assert n.startswith("skipped:") and check not in per_check, (check, n)
        else:
            assert n == str(per_check.get(check, 0)), (check, counts)
    assert "garbled" in skipped
    assert set(per_check) <= set(counts)

    # the step page: each group's findings badge counts the audit's findings on that group
    step = 11
    tab.goto(f"{big_url}/trajectories?{urlencode({'step': step, 'split': 'train'})}")
    tab.wait_for_selector("#groups")
    on_group: dict[int, int] = {}
    for f in audit:
        if f["step"] == step and not f["validate"] and f["sample_index"] is not None:
            on_group[f["sample_index"]] = on_group.get(f["sample_index"], 0) + 1
    for s in sorted({t["sample_index"] for t in truth if t["step"] == step}):
        badge = tab.locator(f"#groups tr[data-sample='{s}'] a.badge.finding")
        if s in on_group:
            assert badge.inner_text() == str(on_group[s]), s
        else:
            assert badge.count() == 0, s
    assert {s for st, s in planted if st == step} <= set(on_group)

    # the outliers planted: each step's OUTLIERS lowest ids; the list's rows wear the badge
    far = set()
    for step in range(STEPS):
        far |= set(sorted(t["id"] for t in truth if t["step"] == step)[:OUTLIERS])
    assert {f["trajectory_id"] for f in audit if f["check"] == "mismatch"} == far
    tab.goto(f"{big_url}/trajectories?{urlencode({'where': 'importance_ratio > 50', 'per': 200})}")
    assert tab.inner_text("#count") == str(len(far))
    rows = tab.locator("table.list tr:has(a.traj-link)")
    assert rows.count() == len(far)
    for row in rows.all():
        tid = row.locator("a.traj-link").get_attribute("href").split("/t/")[1].split("?")[0]
        assert tid in far and "mismatch" in row.locator("a.badge.finding").all_inner_texts(), tid
    rows.first.locator("a.traj-link").click()
    tab.wait_for_selector("h1 .badge.finding")
    assert "mismatch" in tab.locator("h1 .badge.finding").all_inner_texts()
    assert tab.errors == []


def test_compare_page_with_a_changed_copy(
    big_url: str, twin_changed: set[str], truth: list[dict[str, Any]], tab
) -> None:
    planted = {  # those plant_token_change picks: every CHANGE_EVERY-th by sample and rollout
        t["id"]
        for t in truth
        if t["step"] == CHANGED_STEP and (t["sample_index"] * ROLLOUTS + t["rollout_n"]) % CHANGE_EVERY == 0
    }
    assert twin_changed == planted and 0 < len(planted) < PER_STEP
    tab.goto(f"{big_url}/")
    tab.click("header a:text-is('compare')")
    tab.select_option("#compare-form select[name=with]", TWIN)
    with tab.expect_navigation():
        tab.click("#compare-form button")
    tab.wait_for_selector("#pairs")
    expected = {
        "same": STEPS * PER_STEP - len(twin_changed),
        "changed": len(twin_changed),
        "only_a": 0,
        "only_b": 0,
    }
    for key, n in expected.items():
        assert tab.inner_text(f"#compare-summary [data-count={key}]") == str(n), key
    rows = tab.locator("#pairs tr.pair.changed").evaluate_all("rs => rs.map(r => r.id.slice(5))")
    assert set(rows) == twin_changed
    for row in tab.locator("#pairs tr.pair.changed").all():
        assert row.locator("td").nth(1).inner_text() == str(CHANGED_STEP)
        assert row.locator(".difference").inner_text().strip()
    assert tab.errors == []
