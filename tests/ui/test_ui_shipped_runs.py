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
