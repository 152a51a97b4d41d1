"""The UI's data layer: listings cached until the files change, refreshed in the background when slow."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from rlreplay.store import open_run
from rlreplay.ui import data
from rlreplay.ui.data import RunSet, RunView

SAMPLE = Path(__file__).parent.parent / "sample_runs" / "gsm8k-grpo-qwen3"


@pytest.fixture
def growing_run(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the sample run without its last step; the step is put back by the test."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    held = tmp_path / "held"
    shutil.move(run / "spans" / "step=7", held)
    return run, held


def test_listing_is_cached_until_the_files_change(
    growing_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, held = growing_run
    monkeypatch.setattr(data, "SLOW_LISTING_S", 1e9)  # re-read in the request, however long it takes
    view = RunView(open_run(run))
    first = view.listing()
    assert view.listing() is first  # nothing changed: the same table
    version = view.version()
    shutil.move(held, run / "spans" / "step=7")
    second = view.listing()
    assert second.num_rows == first.num_rows + 40  # step 7: 32 training + 8 validation
    assert view.version() != version


def test_a_slow_listing_is_refreshed_in_the_background(
    growing_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, held = growing_run
    monkeypatch.setattr(data, "SLOW_LISTING_S", -1.0)  # every re-read counts as slow
    view = RunView(open_run(run))
    first = view.listing()
    version = view.version()
    shutil.move(held, run / "spans" / "step=7")
    assert view.listing() is first  # served at once from the last listing
    deadline = time.monotonic() + 30
    while view.version() == version:
        assert time.monotonic() < deadline, "the background refresh never finished"
        time.sleep(0.05)
    assert view.listing().num_rows == first.num_rows + 40


def test_a_folder_lists_only_runs_inside_it(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    shutil.copytree(SAMPLE, root / "a")
    (root / "not-a-run").mkdir()
    (root / ".hidden").mkdir()
    shutil.copytree(SAMPLE, tmp_path / "elsewhere")
    (root / "link-out").symlink_to(tmp_path / "elsewhere")
    (root / "link-in").symlink_to(root / "a")
    runs = RunSet(root)
    assert runs.names() == ["a", "link-in"]
    with pytest.raises(data.NotFound):
        runs.get("link-out")
    with pytest.raises(data.NotFound):
        runs.get("..")
