"""The UI's data layer: listings cached until the files change, refreshed in the background when slow."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from support import qwen_tokenizer_dir

from rlreplay.read.open import open_run
from rlreplay.ui import data
from rlreplay.ui.data import RunSet, RunView

SAMPLE = Path(__file__).parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"


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


def test_a_page_looks_at_the_files_once(
    growing_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within one request a run's files are listed once: a step sealed meanwhile shows on the next
    page, never half-way through this one."""
    run, held = growing_run
    monkeypatch.setattr(data, "SLOW_LISTING_S", 1e9)
    view = RunView(open_run(run))
    looked: list[Path] = []
    listed = view.run.file_signature
    monkeypatch.setattr(view.run, "file_signature", lambda: looked.append(run) or listed())
    with data.one_look():
        first = view.listing()
        shutil.move(held, run / "spans" / "step=7")
        assert view.listing() is first
        view.version()
        assert len(looked) == 1
    with data.one_look():
        assert view.listing().num_rows == first.num_rows + 40  # step 7: 32 training + 8 validation
    assert len(looked) == 2


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


def test_a_background_refresh_that_fails_keeps_the_listing_and_says_so_in_one_line(
    growing_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run on an object store that cannot be reached while the listing is re-read in the
    background: the pages keep the listing they had, the terminal gets one line, no traceback."""
    import threading

    from rlreplay.errors import RunError

    run, held = growing_run
    monkeypatch.setattr(data, "SLOW_LISTING_S", -1.0)
    view = RunView(open_run(run))
    first = view.listing()
    escaped: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    real = data.listing
    tried = threading.Event()

    def unreachable(run: object) -> object:
        tried.set()
        raise RunError("s3://bucket/run: Could not connect to server")

    monkeypatch.setattr(data, "listing", unreachable)
    shutil.move(held, run / "spans" / "step=7")
    assert view.listing() is first
    assert tried.wait(30)
    deadline = time.monotonic() + 30
    while view._refreshing and time.monotonic() < deadline:
        time.sleep(0.05)
    assert escaped == []
    assert view.listing() is first or view.listing().num_rows == first.num_rows
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not re-read" in err and "Could not connect to server" in err
    monkeypatch.setattr(data, "listing", real)  # the store is back: the next look re-reads it
    deadline = time.monotonic() + 30
    while view.listing().num_rows != first.num_rows + 40:
        assert time.monotonic() < deadline, "the run was never re-read"
        time.sleep(0.05)


def test_a_run_that_cannot_be_looked_at_is_shown_as_it_was(
    growing_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The store cut while a page looks at the run's files: the page shows the last listing (the
    terminal gets one line), not an error page; a run never read gives the error."""
    from rlreplay.errors import RunError

    run, _ = growing_run
    view = RunView(open_run(run))
    first = view.listing()
    real = view.run.file_signature

    def unreachable(path: Path) -> object:
        raise RunError("s3://bucket/run: Could not connect to server")

    monkeypatch.setattr(view.run, "file_signature", lambda: unreachable(run))
    assert view.listing() is first
    assert view.listing() is first
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Could not connect to server" in err
    never_read = open_run(run)
    monkeypatch.setattr(never_read, "file_signature", lambda: unreachable(run))
    with pytest.raises(RunError, match="Could not connect"):
        RunView(never_read).listing()
    monkeypatch.setattr(view.run, "file_signature", real)
    assert view.listing() is first
    counted = view.counters()
    assert counted == view.run.counters()
    monkeypatch.setattr(view.run, "counters", lambda: unreachable(run))
    assert view.counters() == counted  # the counters read last


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


def test_a_tokenizer_given_to_the_app_overrides_the_manifest(tmp_path: Path) -> None:
    from rlreplay.format import manifest
    from rlreplay.text.token2text import TOKENIZER_FILE

    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    manifest.update_manifest(run, tokenizer=str(tmp_path / "gone"), tokenizer_files=str(tmp_path / "gone"))
    plain = RunView(open_run(run))
    assert plain.decoder() is None and "gone" in (plain.decoder_error or "")
    qwen = qwen_tokenizer_dir()
    assert (qwen / TOKENIZER_FILE).exists()
    given = RunSet(run, tokenizer=str(qwen)).get("run")
    assert given.decoder() is not None and given.decoder_error is None
    assert given.decoder().decode_many([[9707]]) == plain_decode(qwen, 9707)


def plain_decode(folder: Path, token: int) -> list[str]:
    from tokenizers import Tokenizer

    return [Tokenizer.from_file(str(folder / "tokenizer.json")).decode([token], skip_special_tokens=False)]


def test_runs_page_lists_a_run_whose_manifest_is_not_written_yet(tmp_path: Path) -> None:
    """A job that has begun writing spans before its run.json (or with a manifest lacking fields)
    is listed with placeholders, not an error page."""
    from starlette.testclient import TestClient

    from rlreplay.ui.app import create_app

    shutil.copytree(SAMPLE, tmp_path / "done")
    (tmp_path / "starting" / "spans").mkdir(parents=True)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "run.json").write_text("{}")
    with TestClient(create_app(tmp_path)) as client:
        page = client.get("/")
    assert page.status_code == 200, page.text
    for name in ("done", "starting", "bare"):
        assert f">{name}</a>" in page.text


def test_a_tokenizer_named_after_the_run_was_opened_is_used(tmp_path: Path) -> None:
    """A live run opened before its manifest names a tokenizer decodes once the manifest does."""
    import json

    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run)
    named = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(
        json.dumps({k: v for k, v in named.items() if not k.startswith("tokenizer")})
    )
    view = RunView(open_run(run))
    assert view.decoder() is None and "no tokenizer" in (view.decoder_error or "")
    (run / "run.json").write_text(json.dumps(named))
    decoder = view.decoder()
    assert decoder is not None and view.decoder_error is None
    assert decoder.decode([785, 4226, 374]) == "The answer is"


def test_a_selection_is_kept_until_the_listing_changes(
    growing_run: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paging a sorted, filtered list (or moving to the next trajectory in it) does not query again;
    new files give a new selection."""
    import pyarrow.compute as pc

    run, held = growing_run
    monkeypatch.setattr(data, "SLOW_LISTING_S", 1e9)
    view = RunView(open_run(run))
    q = data.ListQuery(where="reward > 0", sort="reward desc, id")
    first = view.selected(q)
    assert view.selected(data.ListQuery(where="reward > 0", sort="reward desc, id", page=3)) is first
    rows = view.listing().to_pylist()
    want = sorted((r for r in rows if r["reward"] is not None and r["reward"] > 0), key=lambda r: r["id"])
    want.sort(key=lambda r: r["reward"], reverse=True)
    assert first["id"].to_pylist() == [r["id"] for r in want] and want
    for n in range(data.SELECTIONS_KEPT):  # others push it out
        view.selected(data.ListQuery(step=str(n)))
    again = view.selected(q)
    assert again is not first and again.equals(first)
    shutil.move(held, run / "spans" / "step=7")
    grown = view.selected(q)
    added = pc.sum(
        pc.greater(view.listing().filter(pc.equal(view.listing()["step"], 7))["reward"], 0)
    ).as_py()
    assert grown.num_rows == first.num_rows + added
