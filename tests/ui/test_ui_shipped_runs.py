"""Every shipped run (``sample_runs/*``) in ``rlreplay ui``, as a user meets it: one app over copies
of them all, one Chromium. No page calls an intact run damaged, and no page shows a path of this
machine."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from ui_support import REPO, serving

SHIPPED = sorted(p for p in (REPO / "sample_runs").iterdir() if (p / "run.json").is_file())


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ui-shipped") / "runs"
    root.mkdir()
    for run in SHIPPED:
        shutil.copytree(run, root / run.name)
    return root


@pytest.fixture(scope="module")
def shipped_url(shipped: Path) -> Iterator[str]:
    from rlreplay.ui.app import create_app

    with serving(create_app(shipped, poll_ms=60_000, allowed_hosts=["127.0.0.1"])) as url:
        yield url


def step_pages(run: Path) -> list[tuple[int, bool]]:
    """Every (step, validate) the run's span files hold, read from the files with pyarrow alone."""
    rows = ds.dataset(sorted(run.glob("spans/**/*.parquet")), format="parquet").to_table(
        columns=["step", "validate"]
    )
    return sorted({(r["step"], bool(r["validate"])) for r in rows.to_pylist() if r["step"] is not None})


#: what a page says when it finds a span file damaged, or a payload it cannot read
DAMAGE = re.compile(r"unreadable|damaged|skipped|could not be read|missing", re.IGNORECASE)


def test_the_shipped_runs_are_all_here() -> None:
    assert len(SHIPPED) >= 3, SHIPPED


@pytest.mark.parametrize("run", [p.name for p in SHIPPED])
def test_every_step_page_then_the_front_page_shows_no_damage(
    run: str, shipped: Path, shipped_url: str, chrome: Any
) -> None:
    steps = step_pages(shipped / run)
    assert steps, run
    context = chrome.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        for step, validate in steps:
            page.goto(f"{shipped_url}/r/{run}/trajectories?step={step}&validate={str(validate).lower()}")
            groups = page.locator("#groups")
            assert groups.count() == 1, (run, step, validate)  # a step page, with its groups
            warned = page.locator(".warn").all_inner_texts()
            assert not [w for w in warned if DAMAGE.search(w)], (run, step, warned)
        page.goto(f"{shipped_url}/r/{run}/")
        page.wait_for_selector("#summary")
        banners = page.locator("#summary .warn").all_inner_texts()
        assert banners == [], (run, banners[:3], len(banners))
        assert not DAMAGE.search(page.locator("#summary").inner_text())
    finally:
        context.close()


#: pages of one kind (a trajectory's, a group's, a prompt's, ...) read per run: the first found,
#: breadth first; every kind of page is read
PER_KIND = 10


def crawl(base: str, starts: list[str]) -> dict[str, str]:
    """Pages of the app reachable from ``starts`` by its links and forms' targets, breadth first,
    as {address: HTML}: up to :data:`PER_KIND` of each kind of page per run, each once whatever
    its query string says about where the user came from or which page of a list it shows."""
    from html.parser import HTMLParser

    import httpx

    class Links(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.found: list[str] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            for name, value in attrs:
                if name in ("href", "action") and value and value.startswith("/r/"):
                    self.found.append(value.split("#")[0])

    def once(path: str) -> str:
        return path.split("?")[0] if re.match(r"/r/[^/]+/(t|group|diff)\b", path) else path

    seen: dict[str, str] = {}
    done: set[str] = set()
    per_kind: dict[tuple[str, str], int] = {}
    todo = list(starts)
    with httpx.Client(base_url=base, timeout=60) as client:
        while todo:
            path = todo.pop(0)
            kind = page_kind(path)
            if once(path) in done or "/api/" in path or "page=" in path:
                continue
            if path not in starts and per_kind.get(kind, 0) >= PER_KIND:
                continue
            done.add(once(path))
            per_kind[kind] = per_kind.get(kind, 0) + 1
            response = client.get(path)
            seen[path] = response.text
            if response.headers.get("content-type", "").startswith("text/html"):
                parser = Links()
                parser.feed(response.text)
                todo += parser.found
    return seen


def page_kind(path: str) -> tuple[str, str]:
    """(run, kind of page) of an address: ``("RUN", "t")`` for ``/r/RUN/t/ID``."""
    found = re.match(r"/r/([^/]+)/([^/?]*)", path)
    return (found[1], found[2]) if found else ("", path)


def test_no_page_shows_a_path_of_this_machine_or_damage(shipped: Path, shipped_url: str) -> None:
    import os

    runs = [p.name for p in SHIPPED]
    starts = ["/"]
    for run in runs:
        base = f"/r/{run}"
        ids = step_ids(shipped / run)
        starts += [
            f"{base}/",
            f"{base}/findings",
            f"{base}/mismatch",
            f"{base}/mismatch?by=turn",
            f"{base}/diff?a={ids[0]}&b={ids[-1]}",
            f"{base}/t/{'f' * 40}",  # no such trajectory
            f"{base}/trajectories?where=no_such_column%20%3E%201",
            *(f"{base}/compare?with={other}" for other in runs if other != run),
        ]
    pages = crawl(shipped_url, starts)
    kinds = {"", "t", "group", "prompt", "trajectories", "findings", "mismatch", "diff", "compare"}
    for run in runs:  # every kind of page of every run was read
        assert kinds <= {kind for r, kind in map(page_kind, pages) if r == run}, run
    local = {str(shipped), str(shipped.resolve()), *(str(shipped / r) for r in runs), os.path.expanduser("~")}
    shown = {(path, where) for path, html in pages.items() for where in local if where in html}
    assert not shown, sorted(shown)
    # and none calls the run damaged
    warned = {
        (path, w) for path, html in pages.items() for w in re.findall(r'class="warn"[^>]*>([^<]*)', html)
    }
    assert not [(path, w) for path, w in warned if DAMAGE.search(w)]


def step_ids(run: Path) -> list[str]:
    """The run's trajectory ids, read from its files with pyarrow alone."""
    rows = ds.dataset(sorted(run.glob("spans/**/*.parquet")), format="parquet").to_table(
        columns=["trajectory_id"]
    )
    return sorted(set(rows["trajectory_id"].to_pylist()))


def test_a_message_names_a_run_never_its_folder(shipped: Path) -> None:
    import os

    from rlreplay.ui.data import RunSet

    run = shipped / SHIPPED[0].name
    one, folder = RunSet(run), RunSet(shipped)
    said = f"{run}/spans/step=1/part-x.parquet: damaged; in {run}; see {os.path.expanduser('~')}/.cache/x"
    home = os.path.expanduser("~")
    assert one.without_paths(said) == (
        f"{run.name}/spans/step=1/part-x.parquet: damaged; in {run.name}; see ~/.cache/x"
    ), home
    assert folder.without_paths(said) == one.without_paths(said)
    assert folder.without_paths(f"no run in {shipped}") == f"no run in {shipped.name}"


def audit_findings(run: Path) -> list[dict[str, Any]]:
    """What ``rlreplay audit --json`` finds in the run, run as the user runs it."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "rlreplay", "audit", str(run), "--json"], capture_output=True, text=True
    )
    assert out.returncode in (0, 1), out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def counts(found: list[dict[str, Any]], checks: set[str] | None = None) -> tuple[dict[Any, int], int]:
    """Findings (of ``checks``: all) per (step, validate), and in all."""
    found = [f for f in found if checks is None or f["check"] in checks]
    per_step: dict[tuple[int, bool], int] = {}
    for f in found:
        if f["step"] is not None:
            key = (f["step"], bool(f["validate"]))
            per_step[key] = per_step.get(key, 0) + 1
    return per_step, len(found)


def front_page_counts(page: Any) -> tuple[dict[tuple[int, bool], int], int, str]:
    """The front page's findings per (step, validate), its total and what it says they count."""
    shown: dict[tuple[int, bool], int] = {}
    for split, validate in (("train", False), ("val", True)):
        for row in page.locator(f"#{split}-stats tr[data-step]").all():
            n = int(row.locator("td.findings").inner_text())
            if n:
                shown[(int(row.get_attribute("data-step")), validate)] = n
    total = int(page.locator("#findings-total").inner_text())
    return shown, total, page.locator("#findings-what").inner_text()


@pytest.mark.parametrize("run", [p.name for p in SHIPPED])
def test_the_front_pages_findings_are_the_audits_or_say_which(run: str, shipped: Path, chrome: Any) -> None:
    from rlreplay.ui.app import create_app

    audited = audit_findings(shipped / run)
    page = chrome.new_page()
    try:
        with serving(create_app(shipped / run, poll_ms=60_000)) as url:  # nothing audited yet
            page.goto(f"{url}/r/{run}/")
            shown, total, what = front_page_counts(page)
            if not what.startswith("every check"):
                named = what.split(": ", 1)[1].split(";")[0].split(" (")[0]
                checks = {c.strip() for c in named.split(",")}
                assert what.startswith("only the checks over the listing") and "findings page" in what
                assert checks and checks < set(AUDIT_CHECKS), what
                # what they count is exactly what the audit's checks of those names find
                assert (shown, total) == counts(audited, checks), what
            page.goto(f"{url}/r/{run}/findings")
            page.goto(f"{url}/r/{run}/")
            shown, total, what = front_page_counts(page)
            assert what.startswith("every check, as rlreplay audit"), what
            assert (shown, total) == counts(audited)
    finally:
        page.close()


#: the checks rlreplay ships (``rlreplay audit --help``)
AUDIT_CHECKS = (
    "retokenization",
    "repetition",
    "garbled",
    "truncated",
    "empty_response",
    "tool_error",
    "parse_error",
    "mismatch",
    "group_collapse",
    "length_drift",
    "reward_drift",
)


def test_a_damaged_file_is_named_and_only_it(tmp_path: Path, chrome: Any) -> None:
    """A shard whose bytes changed: once a page read it, the front page names it, and calls nothing
    else damaged."""
    from rlreplay.ui.app import create_app

    run = tmp_path / SHIPPED[0].name
    shutil.copytree(SHIPPED[0], run)
    shards = sorted(run.glob("spans/step=*/*/*.parquet"))
    assert len(shards) >= 3
    hurt = shards[0]
    data = bytearray(hurt.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    hurt.write_bytes(bytes(data))
    name = hurt.relative_to(run).as_posix()
    page = chrome.new_page()
    try:
        with serving(create_app(run, poll_ms=60_000)) as url:
            for step, validate in step_pages(SHIPPED[0]):
                page.goto(f"{url}/r/{run.name}/trajectories?step={step}&validate={str(validate).lower()}")
            page.goto(f"{url}/r/{run.name}/")
            banners = page.locator("#summary .warn").all_inner_texts()
    finally:
        page.close()
    assert any(name in b and "unreadable" in b for b in banners), banners
    for banner in banners:  # each names it, or counts it: no other file is blamed
        assert set(re.findall(r"spans/\S+?\.parquet", banner)) <= {name}, banner
