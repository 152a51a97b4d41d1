"""The pages where a run is understood, driven in real Chromium: overview trends, step, group,
prompt history, trajectory; numbers checked against ``rlreplay ls/stats --json``."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from ui_support import SHOWCASE, TREND, cli_json


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


def _close(shown: str, value: float) -> bool:
    return abs(float(shown) - value) <= 1e-3 * max(1.0, abs(value))


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (DuckDB's quantile_cont)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


CHART_TEXT_INSIDE = """svgs => svgs.flatMap(svg => {
  const box = svg.viewBox.baseVal;
  return [...svg.querySelectorAll('text')].map(t => {
    const b = t.getBBox();
    return b.x >= 0 && b.y >= 0 && b.x + b.width <= box.width + 0.5 && b.y + b.height <= box.height + 0.5;
  });
})"""


def test_overview_trends_hover_and_click_to_the_step(ui_url, ui_runs: Path, tab) -> None:
    run = str(ui_runs / TREND)
    stats = [r for r in cli_json("stats", run) if not r["validate"]]
    listing = cli_json("ls", run)
    tab.goto(f"{ui_url}/r/{TREND}/")
    labels = tab.locator("#train-stats svg.chart").evaluate_all(
        "s => s.map(e => e.getAttribute('aria-label'))"
    )
    for wanted in ("reward mean", "advantage spread (std)", "response length (tokens)", "importance ratio"):
        assert wanted in labels
    assert "trainer vs rollout log-prob diff" in labels and "zero-std group fraction" in labels
    for row in stats:  # the step table: rlreplay stats' numbers
        cell = tab.locator(f"#train-stats tr[data-step='{row['step']}'] td.reward-mean").inner_text()
        assert _close(cell, row["reward_mean"])
    assert all(tab.locator("svg.chart").evaluate_all(CHART_TEXT_INSIDE))  # no axis label clipped

    # hover step 3 of the reward chart: its mean and p10-p90 band
    rewards = [r["reward"] for r in listing if r["step"] == 3 and not r["validate"]]
    chart = tab.locator("#train-stats svg.chart[aria-label='reward mean']")
    chart.locator("rect.hit[data-step='3']").hover()
    shown = tab.inner_text("#tip")
    values = dict(re.findall(r"(\w+) ([-0-9.e+]+)", shown.split(" · ", 1)[1]))
    assert _close(values["mean"], sum(rewards) / len(rewards))
    assert _close(values["p10"], _percentile(rewards, 0.1)) and _close(
        values["p90"], _percentile(rewards, 0.9)
    )

    chart.locator("a.point:has(rect[data-step='3'])").click()
    tab.wait_for_selector("#count")
    assert "step=3" in tab.url and "validate=false" in tab.url  # the CLI's names
    assert tab.inner_text("#count") == str(len(rewards))
    assert tab.errors == []


def _column(tab, name: str) -> list[str]:
    heads = tab.locator("table.list tr th").all_inner_texts()
    col = [h.split(" ")[0] for h in heads].index(name)
    return [r.locator("td").nth(col).inner_text() for r in tab.locator("table.list tr:has(td)").all()]


def test_step_page_distributions_groups_sort_filter_columns(ui_url, ui_runs: Path, tab) -> None:
    run = str(ui_runs / TREND)
    stats = next(r for r in cli_json("stats", run) if r["step"] == 3 and not r["validate"])
    rows = [r for r in cli_json("ls", run) if r["step"] == 3 and not r["validate"]]
    tab.goto(f"{ui_url}/r/{TREND}/trajectories?step=3&split=train")
    for key in ("reward_mean", "advantage_std", "frac_groups_zero_std", "response_tokens_mean"):
        assert _close(tab.inner_text(f"#step-stats [data-stat={key}]"), stats[key]), key
    counts = tab.locator("#histograms svg[aria-label=reward] rect.hbar").evaluate_all(
        "bs => bs.map(b => Number(b.dataset.count))"
    )
    inside = tab.locator("#histograms svg").evaluate_all(
        """svgs => svgs.every(svg => { const box = svg.getBoundingClientRect();
          return [...svg.querySelectorAll('rect')].every(r => { const b = r.getBoundingClientRect();
            return b.top >= box.top - 0.5 && b.bottom <= box.bottom + 0.5; }); })"""
    )
    assert inside  # every bar is drawn inside its chart
    assert sum(counts) == len(rows) and max(counts) == max(
        sum(1 for r in rows if r["reward"] == v) for v in {r["reward"] for r in rows}
    )

    samples = sorted({r["sample_index"] for r in rows})
    assert tab.locator("#groups tr[data-sample]").count() == len(samples)
    for s in samples:
        members = [r for r in rows if r["sample_index"] == s]
        row = tab.locator(f"#groups tr[data-sample='{s}']")
        assert _close(
            row.locator(".reward-mean").inner_text(), sum(m["reward"] for m in members) / len(members)
        )
        advs = [m["advantage"] for m in members]
        assert _close(row.locator(".adv-spread").inner_text(), max(advs) - min(advs))
        assert row.locator("svg.dots circle").count() == len(members)
        snippet = row.locator(".snippet").inner_text()
        assert f"Question {s}" in snippet and "<|im_start|>" not in snippet
    assert tab.evaluate("document.documentElement.scrollWidth") <= 1280  # fits: nothing hidden
    right = tab.locator("table.list a.group-link").evaluate_all(
        "ls => Math.max(...ls.map(l => l.getBoundingClientRect().right))"
    )
    assert right <= 1280

    tab.click("table.list th a.sort[data-col=response_tokens]")
    tab.click("table.list th a.sort[data-col=response_tokens]")  # second click: descending
    shown = [int(v) for v in _column(tab, "response_tokens")]
    assert shown == sorted((r["response_tokens"] for r in rows), reverse=True)

    tab.fill("input[name=where]", "reward > 0 and rollout_n >= 1")
    tab.click("#columns summary")
    tab.uncheck("#columns input[value=duration_s]")
    tab.click("#filters button[type=submit]")
    tab.wait_for_selector("#count")
    wanted = [r for r in rows if r["reward"] > 0 and r["rollout_n"] >= 1]
    assert tab.inner_text("#count") == str(len(wanted))
    heads = tab.locator("table.list tr th").all_inner_texts()
    assert "duration_s" not in heads and "reward" in [h.split(" ")[0] for h in heads]
    assert tab.errors == []


def test_prompt_history_across_steps(ui_url, ui_runs: Path, tab) -> None:
    rows = [r for r in cli_json("ls", str(ui_runs / TREND)) if r["sample_index"] == 11 and not r["validate"]]
    first = min(rows, key=lambda r: (r["step"], r["rollout_n"]))
    tab.goto(f"{ui_url}/r/{TREND}/t/{first['id']}")
    tab.click("#prompt-link")
    tab.wait_for_selector("#history")
    assert "Question 11" in tab.inner_text("#question") and "<|im_start|>" not in tab.inner_text("#question")
    steps = sorted({r["step"] for r in rows})
    assert [
        int(s) for s in tab.locator("section.pstep").evaluate_all("s => s.map(e => e.dataset.step)")
    ] == steps
    for r in rows:
        line = tab.locator(f"tr[data-id='{r['id']}']")
        assert _close(line.locator(".reward").inner_text(), r["reward"])
        assert line.locator(".length").inner_text() == str(r["response_tokens"])
        answer = line.locator(".answer").inner_text()
        assert "The answer is" in answer and "<|im_end|>" not in answer
    tab.click(f"section.pstep[data-step='{steps[-1]}'] a.group-link")
    tab.wait_for_selector("#group")
    tab.click("#prompt-link")  # and back from the group page
    tab.wait_for_selector("#history")
    assert tab.locator("section.pstep").count() == len(steps)
    assert tab.errors == []


def test_prompt_history_in_pages_of_steps(ui_url, ui_runs: Path) -> None:
    """A page of a prompt's history reads the rollouts of some steps (the latest first); its chart
    has every step, each point opening the page that shows it."""
    rows = [r for r in cli_json("ls", str(ui_runs / TREND)) if r["sample_index"] == 11 and not r["validate"]]
    steps = sorted({r["step"] for r in rows})
    assert len(steps) >= 5
    per = 2
    pages = [steps[max(0, len(steps) - per * k) : len(steps) - per * (k - 1)] for k in range(1, 4)]
    assert sorted(s for page in pages for s in page) == steps
    base = f"{ui_url}/r/{TREND}/prompt?sample_index=11&split=train&per={per}"
    for number, want in enumerate(pages, 1):
        html = _get(f"{base}&page={number}")
        shown = [int(s) for s in re.findall(r'<section class="pstep" id="step-\d+" data-step="(\d+)"', html)]
        assert shown == want
        ids = re.findall(r'<tr class="[^"]*" data-id="([0-9a-f]+)"', html)
        assert sorted(ids) == sorted(r["id"] for r in rows if r["step"] in want)
        points = {
            int(step): link.replace("&amp;", "&")
            for link, step in re.findall(
                r'<a class="point" href="([^"]*)"><rect class="hit"[^>]*data-step="(\d+)"', html
            )
        }
        assert sorted(points) == steps
        for step, link in points.items():
            on = next(k for k, page in enumerate(pages, 1) if step in page)
            assert link.endswith(f"#step-{step}")
            assert (link == f"#step-{step}") == (on == number)
            assert on == number or f"page={on}&" in link + "&"
        assert ('id="older"' in html) == (number < len(pages))
        assert ('id="newer"' in html) == (number > 1)


def test_overview_status_counts_and_step_links(ui_url, ui_runs: Path) -> None:
    """The overview counts trajectories per status as ``ls`` does; a step page links the steps of
    its split before and after it."""
    for run in (TREND, SHOWCASE.name):
        listing = cli_json("ls", str(ui_runs / run))
        want: dict[str, int] = {}
        for r in listing:
            want[r["status"]] = want.get(r["status"], 0) + 1
        html = _get(f"{ui_url}/r/{run}/")
        cards = re.findall(r'<div class="card [^"]*"><div class="big">(\d+)</div>(\w+)</div>', html)
        statuses = {"ok", "error", "incomplete"}  # the other cards are the recorder's counters
        assert {status: int(n) for n, status in cards if status in statuses} == want
        for split, validate in (("train", False), ("val", True)):
            steps = sorted({r["step"] for r in listing if bool(r["validate"]) == validate})
            for at, step in enumerate(steps):
                page = _get(f"{ui_url}/r/{run}/trajectories?step={step}&split={split}")
                links = dict(re.findall(r'data-key="(prev|next)" href="[^"]*step=(-?\d+)', page))
                expected = {}
                if at > 0:
                    expected["prev"] = str(steps[at - 1])
                if at + 1 < len(steps):
                    expected["next"] = str(steps[at + 1])
                assert links == expected, (run, split, step)


def test_group_page_chat_side_by_side(ui_url, ui_runs: Path, tab) -> None:
    for run, step in ((TREND, 3), (SHOWCASE.name, 2)):
        listing = [r for r in cli_json("ls", str(ui_runs / run)) if r["step"] == step and not r["validate"]]
        sample = max(
            {r["sample_index"] for r in listing},
            key=lambda s: len({r["reward"] for r in listing if r["sample_index"] == s}),
        )
        members = {r["id"]: r for r in listing if r["sample_index"] == sample}
        tab.goto(f"{ui_url}/r/{run}/trajectories?step={step}&split=train")
        tab.click(f"#groups tr[data-sample='{sample}'] a.group-link")
        tab.wait_for_selector("#group")
        heads = tab.locator("#group .rollout")
        assert heads.count() == len(members)
        for head in heads.all():
            tid = head.locator("a.traj-link").get_attribute("href").rsplit("/", 1)[1]
            assert _close(head.locator(".reward").inner_text(), members[tid]["reward"])
            assert _close(head.locator(".advantage").inner_text(), members[tid]["advantage"])
        text = tab.inner_text("main")
        assert "<|im_start|>" not in text and "<|im_end|>" not in text
        assert tab.locator("#prompt .bubble.user").count() >= 1
        assert tab.locator("#group .bubble.assistant").count() >= len(members)
        if len({m["reward"] for m in members.values()}) > 1:
            assert "diverges at turn" in tab.inner_text("#group")
    assert tab.errors == []


def test_drill_down_from_an_overview_point_to_a_token(ui_url, ui_runs: Path, tab) -> None:
    from ui_record_job import trend_entropy

    from rlreplay.read.open import open_run

    listing = cli_json("ls", str(ui_runs / TREND))
    tab.goto(f"{ui_url}/r/{TREND}/")
    tab.locator("#train-stats svg.chart[aria-label='reward mean'] a.point:has(rect[data-step='4'])").click()
    tab.wait_for_selector("#groups")
    tab.click("#groups tr[data-sample='10'] a.group-link")
    tab.wait_for_selector("#group")
    tab.click("#group .rollout >> nth=0 >> a.traj-link")
    tab.wait_for_selector("#tokens")
    tid = tab.url.split("/t/")[1].split("?")[0]
    row = next(r for r in listing if r["id"] == tid)
    assert (row["step"], row["sample_index"]) == (4, 10)
    assert tab.inner_text("#duration") == f"{row['duration_s']:.3f} s"
    traj = open_run(ui_runs / TREND).trajectory(tid)
    agent = next(s.output for s in traj.spans if s.kind == "agent")
    trainer = next(s.output["old_log_probs"] for s in traj.spans if s.kind == "signals")
    tokens = tab.locator("#tokens .tk")
    assert tokens.count() == len(agent["response_ids"])

    tab.check("#overlay-switch input[value=mismatch]")
    legend = tab.locator("#legend .lg-mismatch")
    assert legend.is_visible() and "1" in legend.inner_text()  # the scale's end
    assert not tab.locator("#legend .lg-logprob").is_visible()
    k = 2  # a token where trainer and rollout differ (0.02 * step * (k % 3))
    tab.locator("#timeline").evaluate("e => e.scrollIntoView({block: 'start'})")
    tokens.nth(k).hover()
    tip = tab.inner_text("#tip")
    rollout_lp, trainer_lp = agent["response_logprobs"][k], trainer[k]
    assert f"#{k} id {agent['response_ids'][k]}" in tip
    assert f"logprob {rollout_lp:.4f}" in tip and f"trainer {trainer_lp:.4f}" in tip
    assert f"|Δ| {abs(trainer_lp - rollout_lp):.4f}" in tip
    assert f"entropy {trend_entropy(len(trainer))[k]:.4f}" in tip
    tab.check("#overlay-switch input[value=entropy]")
    zero, high = (tokens.nth(i).evaluate("e => getComputedStyle(e).backgroundColor") for i in (0, 8))
    assert zero != high  # entropy 0 vs the highest

    # a model call's span, expanded: decoded text, the ids on demand
    llm = tab.locator("#timeline details.span-row.llm").first
    llm.locator(":scope > summary").click()
    assert "The answer is" in llm.locator(".decoded").last.inner_text()
    assert not llm.locator("details.raw .io").is_visible()

    # keyboard: next in the list the user came from (the group's step, sorted by the list)
    step_rows = sorted(
        (r for r in listing if r["step"] == 4 and not r["validate"]),
        key=lambda r: (r["sample_index"], r["rollout_n"]),
    )
    at = [r["id"] for r in step_rows].index(tid)
    tab.keyboard.press("j")
    tab.wait_for_url(f"**/t/{step_rows[at + 1]['id']}*")
    tab.keyboard.press("k")
    tab.wait_for_url(f"**/t/{tid}*")
    assert tab.errors == []


RECORD_REPLAY_JOB = """
import json, sys
sys.path.insert(0, sys.argv[3])
import rlreplay
from replay_job import run_job
rlreplay.init(sys.argv[1], worker="agent_loop_worker_0")
run_job(json.loads(sys.argv[2]))
rlreplay.close()
"""


def test_compare_page_a_run_and_its_changed_replay(ui_url, ui_runs: Path, tab) -> None:
    import json
    import subprocess
    import sys

    base = {"steps": 2, "samples": 3, "rollouts": 2, "seed": 0, "parser": "v1"}
    changed = {**base, "changes": {"1:2:0:0": 7}, "skip": [[0, 0, 1]], "extra": [[1, 0, 2]]}
    tests = str(Path(__file__).parents[1])
    for name, config in (("job-a", base), ("job-b", changed)):
        cmd = [sys.executable, "-c", RECORD_REPLAY_JOB, str(ui_runs / name), json.dumps(config), tests]
        subprocess.run(cmd, check=True, timeout=180)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlreplay",
            "compare",
            str(ui_runs / "job-a"),
            str(ui_runs / "job-b"),
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    pairs = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    status = [
        ("changed" if not p["same"] else "same") if p["a"] and p["b"] else ("only_a" if p["a"] else "only_b")
        for p in pairs
    ]
    tab.goto(f"{ui_url}/r/job-a/")
    tab.click("header a:text-is('compare')")
    tab.select_option("#compare-form select[name=with]", "job-b")
    tab.click("#compare-form button")
    tab.wait_for_selector("#pairs")
    for key in ("same", "changed", "only_a", "only_b"):
        assert tab.inner_text(f"#compare-summary [data-count={key}]") == str(status.count(key)), key
    assert status.count("changed") >= 1 and status.count("only_a") == 1 and status.count("only_b") == 1
    first = tab.locator("#pairs tr.pair").first
    assert first.locator(".badge").inner_text() == "changed" and first.locator(".difference").inner_text()
    # each changed pair says where and how: the path and both values, as the CLI's --json has them
    for p in pairs:
        if p["a"] and p["b"] and not p["same"]:
            diff = p["first_difference"]
            cell = tab.locator(f"#pair-{p['a']} .difference")
            assert f"at {diff['path']}" in cell.locator(".where").inner_text()
            assert cell.locator(".value.a code").inner_text() == diff["a"]
            assert cell.locator(".value.b code").inner_text() == diff["b"]
    assert tab.locator("#pairs .badge.pairstatus.changed").count() == status.count("changed")
    assert tab.errors == []


def test_long_response_minimap_and_tooltips_across_blocks(ui_url, ui_runs: Path, tab) -> None:
    from support import qwen_tokenizer_dir
    from ui_record_job import TREND_LONG_SAMPLE, TREND_LONG_TOKENS

    from rlreplay.read.open import open_run
    from rlreplay.text.token2text import Decoder

    row = next(r for r in cli_json("ls", str(ui_runs / TREND)) if r["sample_index"] == TREND_LONG_SAMPLE)
    traj = open_run(ui_runs / TREND).trajectory(row["id"])
    ids = next(s.output["response_ids"] for s in traj.spans if s.kind == "agent")
    assert len(ids) == TREND_LONG_TOKENS
    tab.goto(f"{ui_url}/r/{TREND}/t/{row['id']}")
    cells = tab.locator("#minimap .cell")
    per = -(-len(ids) // 240)
    assert cells.count() == -(-len(ids) // per)
    cells.last.click()  # scrolls the tokens box to the last cell's first token (drawn now if not yet)
    k = int(cells.last.get_attribute("data-at"))
    target = tab.locator("#tokens .tk").nth(k)
    box, at = tab.locator("#tokens").bounding_box(), target.bounding_box()
    assert box["y"] <= at["y"] <= box["y"] + box["height"]
    target.hover()
    assert f"#{k} id {ids[k]} " in tab.inner_text("#tip")  # its index counted across blocks
    tab.wait_for_selector(f"#tokens[data-drawn='{len(ids)}']", state="attached")
    assert tab.locator("#tokens .tk").count() == len(ids)
    starts = tab.locator("#tokens .chunk").evaluate_all("cs => cs.map(c => Number(c.dataset.from))")
    size = int(tab.get_attribute("#tokens", "data-chunk"))
    assert starts == list(range(0, len(ids), size))  # each block once, in order
    texts = tab.locator("#tokens .tk").evaluate_all("ts => [0, 1, ts.length - 1].map(i => ts[i].textContent)")
    decoder = Decoder.load(str(qwen_tokenizer_dir()))
    assert texts == [decoder.decode([ids[i]]) for i in (0, 1, len(ids) - 1)]
    answer = decoder.decode(ids).replace("<|im_end|>", "").strip()
    more = tab.locator("#chat .bubble.assistant details.more")  # the long answer's rest, on demand
    assert answer.split()[-1] not in tab.inner_text("#chat")
    more.locator("summary").click()
    assert answer.split()[-1] in more.inner_text()
    assert tab.errors == []


def test_showcase_run_has_data_in_every_overlay(ui_url, tab) -> None:
    """The shipped verl run (bfloat16 rollout, float32 trainer): mask, rollout log-prob and
    trainer-vs-rollout overlays are all on, and a token's tooltip gives both log-probs."""
    from rlreplay.read.open import open_run

    row = next(
        r
        for r in cli_json("ls", str(SHOWCASE), "--step", "1", "--train")
        if (r["sample_index"], r["rollout_n"]) == (1001, 0)
    )
    traj = open_run(SHOWCASE).trajectory(row["id"])
    agent = next(s.output for s in traj.spans if s.kind == "agent")
    trainer = next(s.output["old_log_probs"] for s in traj.spans if s.kind == "signals")
    rollout = agent["response_logprobs"]
    mask = agent["response_mask"]
    diffs = [  # model tokens only: a tool token's rollout log-prob is no log-prob (verl puts 0)
        abs(t - r) if t is not None and r is not None and m else -1.0
        for t, r, m in zip(trainer, rollout, mask)
    ]
    k = max(range(len(diffs)), key=diffs.__getitem__)
    assert diffs[k] > 0  # bfloat16 against float32 differ somewhere

    tab.goto(f"{ui_url}/r/{SHOWCASE.name}/t/{row['id']}")
    tab.wait_for_selector("#tokens")
    for overlay in ("mask", "logprob", "mismatch"):
        assert tab.locator(f"#overlay-switch input[value={overlay}]").is_enabled(), overlay
    tab.check("#overlay-switch input[value=mismatch]")
    assert tab.locator("#legend .lg-mismatch").is_visible()
    tab.locator("#timeline").evaluate("e => e.scrollIntoView({block: 'start'})")
    tab.locator("#tokens .tk").nth(k).hover()
    tip = tab.inner_text("#tip")
    assert f"#{k} id {agent['response_ids'][k]}" in tip
    assert f"logprob {rollout[k]:.4f}" in tip and f"trainer {trainer[k]:.4f}" in tip
    assert f"|Δ| {diffs[k]:.4f}" in tip
    assert tab.errors == []


def _record_pair(ui_runs: Path, names: tuple[str, str]) -> None:
    """Two runs of the replay job: the second with a changed answer, a rollout skipped, one extra."""
    import json
    import subprocess
    import sys

    base = {"steps": 2, "samples": 3, "rollouts": 2, "seed": 0, "parser": "v1"}
    changed = {**base, "changes": {"1:2:0:0": 7}, "skip": [[0, 0, 1]], "extra": [[1, 0, 2]]}
    tests = str(Path(__file__).parents[1])
    for name, config in zip(names, (base, changed)):
        cmd = [sys.executable, "-c", RECORD_REPLAY_JOB, str(ui_runs / name), json.dumps(config), tests]
        subprocess.run(cmd, check=True, timeout=180)


def _statuses(a: Path, b: Path) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """From ``rlreplay compare A B --json``: each trajectory's status in A, in B, and B's twin of A's."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "rlreplay", "compare", str(a), str(b), "--json"],
        capture_output=True,
        text=True,
    )
    in_a, in_b, twin = {}, {}, {}
    for line in out.stdout.splitlines():
        p = json.loads(line)
        status = "only in this run" if not (p["a"] and p["b"]) else "same" if p["same"] else "changed"
        if p["a"]:
            in_a[p["a"]] = status
        if p["b"]:
            in_b[p["b"]] = status
        if p["a"] and p["b"]:
            twin[p["a"]] = p["b"]
    return in_a, in_b, twin


def _row_badges(tab) -> dict[str, str]:
    """The list's trajectory ids and the compare badge each row wears."""
    return {
        row.locator("a.traj-link").get_attribute("href").split("/t/")[1].split("?")[0]: row.locator(
            ".badge.pairstatus"
        ).inner_text()
        for row in tab.locator("table.list tr:has(a.traj-link)").all()
    }


def test_compare_badges_on_trajectories_and_list_rows(ui_url, ui_runs: Path, tab) -> None:
    _record_pair(ui_runs, ("cmp-a", "cmp-b"))
    in_a, in_b, twin = _statuses(ui_runs / "cmp-a", ui_runs / "cmp-b")
    assert {"same", "changed", "only in this run"} <= set(in_a.values())
    changed = next(i for i, s in in_a.items() if s == "changed")
    tab.goto(f"{ui_url}/r/cmp-a/t/{changed}")
    assert tab.locator("#compare-badge").count() == 0  # no comparison shown yet

    tab.goto(f"{ui_url}/r/cmp-a/compare?with=cmp-b")
    tab.wait_for_selector("#pairs")
    for tid, status in in_a.items():  # each trajectory's page wears its status
        tab.goto(f"{ui_url}/r/cmp-a/t/{tid}")
        assert tab.inner_text("#compare-badge") == status, tid
    same = next(i for i, s in in_a.items() if s == "same")
    tab.goto(f"{ui_url}/r/cmp-a/t/{same}")
    assert tab.get_attribute("#compare-badge", "href") == f"/r/cmp-b/t/{twin[same]}"
    tab.goto(f"{ui_url}/r/cmp-a/t/{changed}")
    tab.click("#compare-badge")  # to the compare view of that pair
    tab.wait_for_selector(f"#pair-{changed}")
    assert f"#pair-{changed}" in tab.url and "with=cmp-b" in tab.url
    assert tab.locator(f"#pair-{changed} .badge").inner_text() == "changed"
    for tid, status in in_b.items():  # the other run's pages too, from its side
        tab.goto(f"{ui_url}/r/cmp-b/t/{tid}")
        assert tab.inner_text("#compare-badge") == status, tid

    # the list's rows wear them
    tab.goto(f"{ui_url}/r/cmp-a/trajectories")
    shown = _row_badges(tab)
    assert shown == in_a
    assert tab.errors == []


def test_a_replay_wears_compare_badges_against_its_source(ui_url, ui_runs: Path, tab) -> None:
    """A run whose manifest names its source (as ``rlreplay replay`` writes it) is compared with it."""
    from rlreplay.playback import ReplayConfig

    _record_pair(ui_runs, ("rpl-source", "rpl-replay"))
    ReplayConfig.of(ui_runs / "rpl-source", "llm").write_manifest(ui_runs / "rpl-replay")
    _, in_replay, _ = _statuses(ui_runs / "rpl-source", ui_runs / "rpl-replay")
    tab.goto(f"{ui_url}/r/rpl-replay/trajectories")
    shown = _row_badges(tab)
    assert shown == in_replay
    changed = next(i for i, s in in_replay.items() if s == "changed")
    tab.goto(f"{ui_url}/r/rpl-replay/t/{changed}")
    assert tab.inner_text("#compare-badge") == "changed"
    tab.click("#compare-badge")
    tab.wait_for_selector(f"#pair-{changed}")
    assert "/r/rpl-replay/compare?with=rpl-source" in tab.url
    assert tab.errors == []


def test_a_replayed_trajectory_page_says_why_it_diverged(ui_url, ui_runs: Path) -> None:
    """A run made by ``rlreplay replay`` (another tool reply: some trajectories diverge): each
    trajectory page shows its replay status, its source trajectory and why it diverged, as
    ``ls --json`` lists them."""
    import html
    import json
    import subprocess
    import sys

    base = {"steps": 1, "samples": 3, "rollouts": 2, "seed": 0, "parser": "v1"}
    job = [sys.executable, str(Path(__file__).parents[1] / "replay_job.py")]
    for args, config in (
        (["record", "--out", str(ui_runs / "div-source")], base),
        (
            ["replay", str(ui_runs / "div-source"), "--out", str(ui_runs / "div-replay")],
            {**base, "tool_seed": 1},
        ),
    ):
        command = [sys.executable, "-m", "rlreplay", *args, "--framework", "generic", "--", *job]
        subprocess.run([*command, json.dumps(config)], check=True, capture_output=True, timeout=180)
    rows = cli_json("ls", str(ui_runs / "div-replay"))
    assert {r["replay"] for r in rows} == {"served", "diverged"}
    for row in rows:
        page = _get(f"{ui_url}/r/div-replay/t/{row['id']}")
        status = re.search(r'<td id="replay-status">([^<]*)</td>', page)
        reason = re.search(r'<td colspan="2" id="replay-reason">([^<]*)</td>', page)
        assert status and reason, row["id"]
        assert status.group(1) == row["replay"]
        assert html.unescape(reason.group(1)) == (row["replay_reason"] or "–")
        assert f"<code>{row['replay_of']}</code>" in page
    assert "replay-status" not in _get(
        f"{ui_url}/r/div-source/t/{cli_json('ls', str(ui_runs / 'div-source'))[0]['id']}"
    )


def _exported(run: str, step: int, tmp_path: Path) -> list[dict]:
    """``rlreplay export`` of one training step: each trajectory's chat messages."""
    import json
    import subprocess
    import sys

    out = tmp_path / f"step-{step}.jsonl"
    job = [sys.executable, "-m", "rlreplay", "export", run, "--step", str(step), "--train", "-o", str(out)]
    subprocess.run(job, check=True, capture_output=True)
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def test_step_page_snippets_are_the_groups_prompts(ui_url, ui_runs: Path, tmp_path: Path) -> None:
    """Each group's snippet (its title holds the whole text) is the first user message of its first
    rollout, as ``rlreplay export`` gives it."""
    import html as markup

    for name, step in ((SHOWCASE.name, 1), (TREND, 3)):
        records = _exported(str(ui_runs / name), step, tmp_path)
        firsts: dict[int, dict] = {}
        for r in sorted(records, key=lambda r: r["rollout_n"]):
            firsts.setdefault(r["sample_index"], r)
        page = _get(f"{ui_url}/r/{name}/trajectories?step={step}&split=train")
        shown = {
            int(s): markup.unescape(t)
            for s, t in re.findall(
                r'<tr data-sample="(-?\d+)"><td>[^<]*</td><td class="snippet" title="([^"]*)"', page
            )
        }
        assert firsts and sorted(shown) == sorted(firsts), name
        for s, r in firsts.items():
            want = next(m["content"] for m in r["messages"] if m["role"] == "user")
            assert want and shown[s] == want, (name, s)


def test_prompt_history_answers_are_the_last_assistant_messages(
    ui_url, ui_runs: Path, tmp_path: Path
) -> None:
    """Each rollout's answer on the prompt's history is the last assistant message ``rlreplay export``
    gives (the trend run's trainer signals carry per-token arrays the page does not read)."""
    import html as markup

    rows = [r for r in cli_json("ls", str(ui_runs / TREND)) if r["sample_index"] == 11 and not r["validate"]]
    steps = sorted({r["step"] for r in rows})[-2:]
    want = {}
    for step in steps:
        for r in _exported(str(ui_runs / TREND), step, tmp_path):
            if r["sample_index"] == 11:
                want[r["id"]] = [m["content"] for m in r["messages"] if m["role"] == "assistant"][-1]
    page = _get(f"{ui_url}/r/{TREND}/prompt?sample_index=11&split=train&per=2")
    shown = {
        i: markup.unescape(a)
        for i, a in re.findall(
            r'<tr class="[^"]*" data-id="([0-9a-f]+)">.*?<td class="answer"><pre>(.*?)</pre>', page, re.S
        )
    }
    assert sorted(shown) == sorted(want) and len(want) >= 2
    for i, answer in want.items():
        assert answer and len(answer) <= 600 and shown[i] == answer, i
