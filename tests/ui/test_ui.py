"""``rlreplay ui`` in real headless Chromium (Playwright, Debian's /usr/bin/chromium).

One app server (uvicorn in a thread) and one browser per module, over a folder of runs: a copy
of the shipped sample run, a run whose recorded text is HTML, a symlink leading out of the
folder, and (in the live test) a run being recorded by another process.
"""

from __future__ import annotations

import http.client
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from rlreplay.format import manifest
from rlreplay.read.open import open_run
from rlreplay.read.selection import listing as c2_listing
from rlreplay.text.conversation import turns
from rlreplay.text.token2text import Decoder

HERE = Path(__file__).parents[1]
SAMPLE = HERE.parent / "sample_runs" / "gsm8k-grpo-qwen3"
JOB = HERE / "ui_record_job.py"

sys.path.insert(0, str(HERE))
from ui_record_job import (  # noqa: E402
    HOSTILE_ARG,
    HOSTILE_ERROR,
    HOSTILE_EXPERIMENT,
    HOSTILE_TEXT,
    tokenizer_dir,
)
from ui_support import serving  # noqa: E402

QWEN = tokenizer_dir()
ODD_NAME = "odd <b>run #1?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ui_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ui") / "runs"
    root.mkdir()
    shutil.copytree(SAMPLE, root / SAMPLE.name)
    subprocess.run([sys.executable, str(JOB), "hostile", str(root / "hostile")], check=True, timeout=120)
    shutil.copytree(root / "hostile", root / "no-tokenizer")
    manifest.update_manifest(root / "no-tokenizer", tokenizer=str(root / "missing-tokenizer"))
    shutil.copytree(root / "hostile", root / ODD_NAME)
    shutil.copytree(root / "hostile", root / "lossy")
    (root / "lossy" / "_workers" / "w9-99.json").write_text('{"spans": 5, "dropped": 3, "lost": 2}')
    outside = root.parent / "outside"
    shutil.copytree(root / "hostile", outside / "secret-run")
    (root / "escape").symlink_to(outside / "secret-run")
    SNAPSHOT.update(_snapshot(root))
    return root


SNAPSHOT: dict[str, tuple[int, int]] = {}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under the runs (not following links) with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in root.rglob("*")
        if not p.is_symlink() and p.is_file() and p.relative_to(root).parts[0] != "live-run"
    }


@pytest.fixture(scope="module")
def server(ui_root: Path):
    from rlreplay.ui.app import create_app

    with serving(create_app(ui_root, poll_ms=300, allowed_hosts=["127.0.0.1", "localhost"])) as url:
        yield url


@pytest.fixture
def page(tab):
    tab.set_viewport_size({"width": 1300, "height": 900})
    return tab


def _shot(page, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 1000


# ---- clicking through the pages ---------------------------------------------------------------


def test_click_from_overview_to_step_trajectory_group_and_diff(server, page, tmp_path: Path) -> None:
    run = open_run(SAMPLE)
    listing = c2_listing(run)
    step5 = listing.filter(pc.and_(pc.equal(listing["step"], 5), pc.invert(listing["validate"])))

    page.goto(server + "/")
    page.click(f"text={SAMPLE.name}")
    page.wait_for_selector("#train-stats")
    assert page.inner_text("#total") == str(listing.num_rows)
    train_charts = page.locator("#train-stats svg.chart")
    assert train_charts.count() >= 2
    labels = [train_charts.nth(i).get_attribute("aria-label") for i in range(train_charts.count())]
    assert "reward mean" in labels and "zero-std group fraction" in labels
    assert page.locator("#val-stats svg.chart").count() >= 1  # validation apart
    assert page.locator("#losses").count() == 0  # nothing lost in the sample run
    assert "gsm8k-grpo-qwen3" in page.inner_text("#manifest")
    _shot(page, tmp_path / "1-overview.png")

    page.click("#train-stats a.step-link:text-is('step 5')")
    page.wait_for_selector("a.traj-link")
    assert page.inner_text("#count") == str(step5.num_rows)
    shown = {page.locator("a.traj-link").nth(i).inner_text() for i in range(step5.num_rows)}
    assert shown == {i[:12] for i in step5["id"].to_pylist()}
    _shot(page, tmp_path / "2-step.png")

    # a trajectory with a tool call: chat bubbles, tool table, span timeline, tokens
    with_tool = step5.filter(pc.greater(step5["tool_calls"], 0))["id"][0].as_py()
    page.click(f"a.traj-link[href*='/t/{with_tool}']")
    page.wait_for_selector("#chat")
    traj = run.trajectory(with_tool)
    assert with_tool in page.inner_text("h1")
    roles = page.locator("#chat .bubble .role").all_inner_texts()
    assert any(r.lower().startswith("assistant") for r in roles)
    assert any(r.lower().startswith("tool") for r in roles)
    first_turn = next(t for t in turns(traj, Decoder.load(str(QWEN))) if t.role == "assistant")
    assert first_turn.text[:40] in page.inner_text("#chat .bubble.assistant >> nth=0")  # decoded text
    assert page.locator("#chat .call").count() >= 1  # the parsed tool call, formatted
    timeline = page.inner_text("#timeline")
    for span in traj.spans:
        assert span.name in timeline
    bars = page.locator("#timeline .bar")
    assert bars.count() == len(traj.spans)
    tokens = page.locator("#tokens .tk")
    agent_out = next(s.output for s in traj.spans if s.kind == "agent")
    assert tokens.count() == len(agent_out["response_ids"])
    assert page.locator("#tokens .tk.m0").count() == agent_out["response_mask"].count(0)
    mask_bg = tokens.first.evaluate("e => getComputedStyle(e).backgroundColor")
    page.check("#overlay-switch input[value=logprob]")
    lp_bg = tokens.first.evaluate("e => getComputedStyle(e).backgroundColor")
    assert lp_bg != mask_bg  # the overlay switched to log-probs
    _shot(page, tmp_path / "3-trajectory.png")

    page.click("#group-link")
    page.wait_for_selector("#group")
    group = listing.filter(
        pc.and_(
            pc.and_(
                pc.equal(listing["step"], traj.step), pc.equal(listing["sample_index"], traj.sample_index)
            ),
            pc.invert(listing["validate"]),
        )
    )
    heads = page.locator("#group .rollout .rhead")
    assert heads.count() == group.num_rows
    rewards = [float(h.locator("b").first.inner_text()) for h in heads.all()]
    assert rewards == sorted(rewards, reverse=True)
    assert "best" in heads.first.inner_text()
    diverging = page.locator("#group .divergence")
    assert diverging.count() >= 1 and "diverges at turn" in diverging.first.inner_text()
    _shot(page, tmp_path / "4-group.png")

    page.click("#group a.diff-link >> nth=0")
    page.wait_for_selector(".divergence")
    assert "first divergence" in page.inner_text(".divergence")
    assert page.locator("section.turn.changed").count() >= 1
    _shot(page, tmp_path / "5-diff.png")
    assert page.errors == []  # type: ignore[attr-defined]


def test_trajectory_list_selection_sort_and_pages(server, page) -> None:
    listing = c2_listing(open_run(SAMPLE))
    base = f"{server}/r/{SAMPLE.name}/trajectories"
    page.goto(f"{base}?step=1..3,7&split=train&where=reward+>+0&sort=reward+desc,+duration_s&per=25")
    steps = pc.is_in(listing["step"], value_set=pa.array([1, 2, 3, 7]))
    wanted = listing.filter(
        pc.and_(pc.and_(steps, pc.invert(listing["validate"])), pc.greater(listing["reward"], 0))
    )
    assert page.inner_text("#count") == str(wanted.num_rows)
    assert f"page 1 of {-(-wanted.num_rows // 25)}" in page.inner_text("#listing")
    col = page.locator("table.list tr th").all_inner_texts().index("reward")
    first_page = [
        float(r.locator("td").nth(col).inner_text()) for r in page.locator("table.list tr.ok").all()
    ]
    assert len(first_page) == 25 and first_page == sorted(first_page, reverse=True)
    page.click("a[rel=next]")
    page.wait_for_selector("a[rel=prev]")
    assert "page 2 of" in page.inner_text("#listing")
    assert "where=reward" in page.url  # the selection stays in the shareable URL

    page.goto(f"{base}?where=no_such_column+>+1")
    assert "no_such_column" in page.inner_text("#error")
    page.goto(f"{base}?sample_index=730&split=val")
    assert page.inner_text("#count") == str(
        listing.filter(pc.and_(pc.equal(listing["sample_index"], 730), listing["validate"])).num_rows
    )


def test_without_a_tokenizer_token_ids_are_shown(server, page, ui_root: Path) -> None:
    run = open_run(ui_root / "no-tokenizer")
    traj = run.trajectory(run.trajectories()["id"][0].as_py())
    page.goto(f"{server}/r/no-tokenizer/t/{traj.id}")
    assert "missing-tokenizer" in page.inner_text(".warn")
    first = next(t for t in turns(traj) if t.role == "assistant")
    assert " ".join(map(str, first.token_ids)) in page.inner_text("#chat .bubble.assistant >> nth=0")
    assert page.locator("#tokens .tk").count() > 0


def test_a_run_named_with_url_and_html_characters(server, page) -> None:
    page.goto(server + "/")
    page.click(f"#runs a:text-is('{ODD_NAME}')")
    page.wait_for_selector("#total")
    assert page.inner_text("h1") == ODD_NAME and page.inner_text("#total") == "3"
    page.click("a.step-link >> nth=0")
    page.click("a.traj-link >> nth=0")
    page.wait_for_selector("#chat")
    assert HOSTILE_TEXT in page.inner_text("#chat")


def test_recording_losses_are_prominent(server, page) -> None:
    page.goto(f"{server}/r/lossy/")
    alarm = page.inner_text("#losses")
    assert "dropped 3" in alarm and "lost 2" in alarm and "spilled" not in alarm
    bad = page.locator(".card.bad").all_inner_texts()
    assert any("dropped" in b for b in bad) and not any("spilled" in b for b in bad)
    page.goto(f"{server}/r/hostile/")
    assert page.locator("#losses").count() == 0 and page.locator(".card.bad").count() == 0


# ---- safety -----------------------------------------------------------------------------------


def _hostile_ids(ui_root: Path) -> list[str]:
    return open_run(ui_root / "hostile").trajectories()["id"].to_pylist()


def test_recorded_html_renders_as_text(server, page, ui_root: Path, tmp_path: Path) -> None:
    ids = _hostile_ids(ui_root)
    failing = next(i for i in ids if open_run(ui_root / "hostile").trajectory(i).rollout_n == 1)
    page.goto(f"{server}/r/hostile/t/{failing}")
    page.wait_for_selector("#chat")
    chat = page.inner_text("#chat")
    assert HOSTILE_TEXT in chat  # shown literally, as typed
    assert HOSTILE_ARG in chat  # the parsed tool call's argument
    assert "1 calls, 1 errors" in page.inner_text("table.facts")  # the failed tool call, in the timings
    tools = page.inner_text("table.tools")
    assert HOSTILE_ERROR in tools and HOSTILE_ARG in tools
    assert HOSTILE_TEXT.split()[0] in page.inner_text("#tokens")
    assert page.is_disabled("#overlay-switch input[value=mismatch]")  # no trainer log-probs here
    scripts = page.eval_on_selector_all("script[src]", "els => els.map(e => e.getAttribute('src'))")
    assert scripts == ["/static/live.js", "/static/ui.js"]
    assert page.locator("main img").count() == 0
    assert page.evaluate("typeof window.__xss") == "undefined"
    _shot(page, tmp_path / "hostile-trajectory.png")

    # the markup itself is escaped (not merely blocked by the content security policy)
    with urllib.request.urlopen(f"{server}/r/hostile/t/{failing}") as resp:
        raw = resp.read().decode()
        assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    assert "<script>window.__xss" not in raw and "&lt;script&gt;window.__xss" in raw
    assert "<img src=x" not in raw

    for path in (f"/r/hostile/group/{failing}", f"/r/hostile/diff?a={ids[0]}&b={ids[1]}", "/"):
        page.goto(server + path)
        page.wait_for_selector("main")
        assert page.locator("main img, main i").count() == 0
        assert page.evaluate("typeof window.__xss") == "undefined"
    assert HOSTILE_EXPERIMENT in page.inner_text("#runs")
    assert page.errors == []  # type: ignore[attr-defined]


def test_trainer_vs_rollout_mismatch_overlay(server, page, ui_root: Path) -> None:
    run = open_run(ui_root / "hostile")
    traj = next(run.trajectory(i) for i in _hostile_ids(ui_root) if run.trajectory(i).rollout_n == 0)
    trainer = next(s.output["old_log_probs"] for s in traj.spans if s.kind == "signals")
    page.goto(f"{server}/r/hostile/t/{traj.id}")
    assert page.inner_text("#advantage") == "0.75"  # from the trainer's signals span
    assert page.inner_text("#logprob-diff-max") == "0.5"
    tokens = page.locator("#tokens .tk")
    assert tokens.count() == len(trainer)
    page.check("#overlay-switch input[value=mismatch]")
    colours = [tokens.nth(i).evaluate("e => getComputedStyle(e).backgroundColor") for i in range(6)]
    assert colours[0] != colours[1] and colours[1] == colours[2]  # token 0 drifted by 0.5, 1 and 2 did not
    tokens.nth(0).hover()
    assert "trainer" in page.inner_text("#tip")


def _raw_get(server: str, path: str, host: str | None = None, follow: int = 3) -> tuple[int, str]:
    """A GET with the path sent exactly as written (no client-side normalization); redirects
    within the app are followed the same way."""
    hostport = server.removeprefix("http://")
    conn = http.client.HTTPConnection(hostport, timeout=10)
    conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
    conn.putheader("Host", host or hostport)
    conn.endheaders()
    resp = conn.getresponse()
    body = resp.read().decode(errors="replace")
    conn.close()
    location = resp.getheader("Location")
    if 300 <= resp.status < 400 and location and follow:
        return _raw_get(server, location.removeprefix(server), host, follow - 1)
    return resp.status, body


@pytest.mark.parametrize(
    "path",
    [
        "/static/../app.py",
        "/static/..%2fapp.py",
        "/static/%2e%2e/app.py",
        "/static/%2e%2e%2f%2e%2e%2fstore.py",
        "/static//etc/passwd",
        "/static/%2fetc%2fpasswd",
        "/r/../../etc/passwd",
        "/r/%2e%2e/",
        "/r/..%2f..%2fetc/",
        "/r/%2fetc/",
        "/r/escape/",
        "/r/escape/trajectories",
        "/r/hostile/t/..%2f..%2frun.json",
        "/r/hostile/t/%2e%2e",
        "/r/hostile/group/%2e%2e%2f",
    ],
)
def test_paths_outside_the_runs_are_not_served(server, path: str) -> None:
    status, body = _raw_get(server, path)
    assert status in (400, 404), (path, status)
    assert "root:" not in body and "secret-run" not in body and "import " not in body


def test_symlinked_run_is_not_listed_and_reads_are_get_only(server, ui_root: Path) -> None:
    assert (ui_root / "escape" / "run.json").exists()  # the symlink works on disk
    status, body = _raw_get(server, "/")
    assert status == 200 and "hostile" in body and "escape" not in body
    assert _raw_get(server, "/static/style.css")[0] == 200  # control: a shipped asset is served
    assert _raw_get(server, "/", host="evil.example")[0] == 400  # DNS rebinding: foreign Host refused
    req = urllib.request.Request(f"{server}/r/hostile/", method="POST", data=b"x")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req)
    assert info.value.code == 405


# ---- live -------------------------------------------------------------------------------------


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"recording job exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {path.name}"
        time.sleep(0.05)


def test_live_run_appears_and_new_trajectories_show_up(server, page, ui_root: Path, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    page.goto(server + "/")
    page.wait_for_selector("#runs")
    assert "live-run" not in page.inner_text("#runs")
    control = tmp_path / "control"
    control.mkdir()
    proc = subprocess.Popen([sys.executable, str(JOB), "live", str(ui_root / "live-run"), str(control)])
    try:
        _wait_file(control / "ready", proc)
        page.wait_for_selector("#runs a:text-is('live-run')")  # the new run appears on the open page
        page.click("#runs a:text-is('live-run')")
        page.wait_for_selector("#total")
        page.goto(f"{server}/r/live-run/trajectories")
        page.wait_for_selector("#count")
        assert page.inner_text("#count") == "1"
        assert page.locator("#live-dot").count() == 1  # a recorder holds the run's lease
        updates = int(page.evaluate("document.body.dataset.updates || '0'"))
        (control / "go").touch()
        _wait_file(control / "written", proc)
        expect(page.locator("#count")).to_have_text("2", timeout=60_000)
        assert int(page.evaluate("document.body.dataset.updates")) > updates  # no reload: swapped in place
        cells = page.locator("table.list tr").nth(2).locator("td").all_inner_texts()
        assert cells[2:4] == ["1", "7"]  # step 1, sample 7: the new trajectory
        _shot(page, tmp_path / "live.png")
        page.click("a.traj-link >> nth=1")
        page.wait_for_selector("#chat")
        assert "a brand new trajectory" in page.inner_text("#chat")
    finally:
        (control / "stop").touch()
        proc.wait(timeout=60)
    assert proc.returncode == 0
    page.goto(f"{server}/r/live-run/trajectories")
    assert page.inner_text("#count") == "2" and page.locator("#live-dot").count() == 0  # finished


def test_pages_never_write_to_the_runs(server, ui_root: Path) -> None:
    """Runs last: every page above was served without adding, changing or removing a file."""
    assert SNAPSHOT and _snapshot(ui_root) == SNAPSHOT
