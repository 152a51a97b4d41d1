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


# ---- a run whose keys mix ints and strings -------------------------------------------------------


def _record_mixed_run(run_dir: Path) -> None:
    """Trajectories keyed by ints and by strings in one run: sample 0 (an int) and sample "s-1"
    (a string) at steps 1 and 2, two rollouts each, one rollout numbered by a string."""
    import rlreplay

    rlreplay.init(run_dir, experiment="mixed", worker="w0")

    @rlreplay.trace_op
    def generate(prompt: str) -> str:
        return prompt + " answer"

    for step in (1, 2):
        for sample in (0, "s-1"):
            for rollout in (0, 1 if sample == 0 else "r-1"):
                with rlreplay.trajectory(step=step, sample_index=sample, rollout_n=rollout):
                    generate(f"question {sample}")
    rlreplay.flush()
    rlreplay.close()


def _root_keys(run_dir: Path) -> dict[str, tuple]:
    """(step, sample_index, rollout_n) of every trajectory, read with pyarrow from the span files."""
    import pyarrow.parquet as pq

    out: dict[str, tuple] = {}
    for f in sorted(run_dir.glob("spans/step=*/worker=*/*.parquet")):
        for r in pq.read_table(f).to_pylist():
            if r["parent_id"] is None:
                out[r["trajectory_id"]] = tuple(
                    r[k] if r[k] is not None else r[f"{k}_str"] for k in ("step", "sample_index", "rollout_n")
                )
    return out


def test_every_page_works_on_a_run_whose_keys_mix_ints_and_strings(tmp_path: Path) -> None:
    """A string sample_index beside int ones (and a string rollout_n) is shown, listed, grouped and
    selected on every page (it once answered 500: pyarrow cannot compare int64 with a string)."""
    from urllib.parse import urlencode

    from starlette.testclient import TestClient

    from rlreplay.ui.app import create_app

    run_dir = tmp_path / "mixed"
    _record_mixed_run(run_dir)
    keys = _root_keys(run_dir)
    assert len(keys) == 8 and {k[1] for k in keys.values()} == {0, "s-1"}
    with TestClient(create_app(run_dir), raise_server_exceptions=False) as client:
        assert client.get("/r/mixed/").status_code == 200
        for tid, (step, sample, _) in keys.items():
            page = client.get(f"/r/mixed/t/{tid}")
            assert page.status_code == 200, (sample, page.text[-400:])
            siblings = [t for t, k in keys.items() if k[:2] == (step, sample) and t != tid]
            assert siblings and all(f"b={t}" in page.text for t in siblings)
            assert client.get(f"/r/mixed/group/{tid}").status_code == 200
        for sample in (0, "s-1"):
            mine = [t for t, k in keys.items() if k[1] == sample]
            listed = client.get("/r/mixed/trajectories?" + urlencode({"sample_index": sample}))
            assert listed.status_code == 200
            assert all(t in listed.text for t in mine)
            assert not any(t in listed.text for t in keys if t not in mine)
            if isinstance(sample, str):  # shown as recorded
                assert listed.text.count(f"<td>{sample}</td>") == len(mine)
            for split in ({"split": "train"}, {"validate": "false"}):  # older links, and the CLI's name
                prompt = client.get("/r/mixed/prompt?" + urlencode({"sample_index": sample, **split}))
                assert prompt.status_code == 200, prompt.text[-400:]
                assert all(t in prompt.text for t in mine)
        for step in (1, 2):
            page = client.get(f"/r/mixed/trajectories?step={step}&validate=false")
            assert page.status_code == 200, page.text[-400:]
            assert 'data-sample="0"' in page.text and 'data-sample="s-1"' in page.text  # two groups
        for rollout in (1, "r-1"):
            mine = [t for t, k in keys.items() if k[2] == rollout]
            listed = client.get("/r/mixed/trajectories?" + urlencode({"rollout_n": rollout}))
            assert listed.status_code == 200 and all(t in listed.text for t in mine)
            assert not any(t in listed.text for t in keys if t not in mine)
        assert listed.text.count("<td>r-1</td>") == len(mine)
        a, b = (t for t, k in keys.items() if k[:2] == (1, "s-1"))
        assert client.get(f"/r/mixed/diff?a={a}&b={b}").status_code == 200


def test_the_trajectory_list_selects_by_worker_and_shows_it() -> None:
    """``?worker=NAME`` keeps what that worker recorded (its root spans, read with pyarrow), and
    the worker column shows it."""
    import re

    import pyarrow.parquet as pq
    from starlette.testclient import TestClient

    from rlreplay.ui.app import create_app

    by_worker: dict[str, set[str]] = {}
    for f in SAMPLE.glob("spans/step=*/worker=*/*.parquet"):
        for r in pq.read_table(f, columns=["trajectory_id", "parent_id", "kind", "worker"]).to_pylist():
            if r["parent_id"] is None and r["kind"] != "signals":
                by_worker.setdefault(r["worker"], set()).add(r["trajectory_id"])
    assert len(by_worker) == 2
    with TestClient(create_app(SAMPLE)) as client:
        for worker, mine in by_worker.items():
            page = client.get(
                f"/r/{SAMPLE.name}/trajectories", params={"worker": worker, "col": "worker", "per": 500}
            )
            assert page.status_code == 200, page.text[-400:]
            assert re.search(r'<span id="count">(\d+)</span>', page.text).group(1) == str(len(mine))
            shown = set(re.findall(r'href="[^"]*/t/([0-9a-f]{32})\?', page.text))
            assert shown == mine
            assert page.text.count(f"<td>{worker}</td>") == len(mine)
            assert f'name="worker" value="{worker}"' in page.text  # the form keeps it


def test_a_list_link_carries_the_whole_query() -> None:
    """Links of the list (sort headers, pages, prev/next) are its query again, whatever it holds."""
    from urllib.parse import urlencode

    from starlette.datastructures import QueryParams

    q = data.ListQuery(
        step="3..7,-1",
        sample_index="s1-3,12",
        rollout_n="0",
        validate=False,
        experiment="e",
        worker="w0",
        status="ok",
        where="reward > 0",
        sort="reward desc",
        cols="reward,worker",
        page=3,
        per=25,
    )
    assert data.ListQuery.from_params(QueryParams(urlencode(q.params()))) == q
    again = data.ListQuery.from_params(QueryParams(urlencode(q.params(sort="id", page=1))))
    assert (again.sort, again.page, again.where, again.validate) == ("id", 1, "reward > 0", False)
    assert data.ListQuery.from_params(QueryParams("split=val")).validate is True  # an older link
