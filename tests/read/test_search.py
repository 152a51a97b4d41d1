"""Text search, ``ls --grep``: the trajectories whose decoded response or tool output matches a regular
expression, with every other selection option, from the cache of decoded text as from the spans.

The truth is computed here: each trajectory's response ids (the agent loop's, split where its
mask changes: model turns, tool turns) and its tool calls' output texts, decoded with the
``tokenizers`` library itself and searched with Python's ``re``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import grep_truth, memory_store_copy, qwen_tokenizer_dir, searched_texts

from rlreplay.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "sample_runs" / "verl-toolagent-smollm2"  # tool calls, tool errors, a tokenizer
#: Patterns of the response and tool output; the last is in every prompt and nowhere else.
PATTERNS = ("error", r"\d+\.\d+", "(?i)NEVER CLOSED", r"^\d{3}$")
PROMPT_ONLY = "function signatures"


@pytest.fixture(scope="module")
def truth() -> dict[str, tuple[list[str], str]]:
    return searched_texts(RUN, RUN / "tokenizer.json")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of decoded text of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "rlreplay" / "text"


def ls_ids(capsys, *args: str) -> list[str]:
    capsys.readouterr()
    assert main(["ls", *args, "--json"]) == 0
    return [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()]


def test_grep_finds_what_the_decoded_text_holds(truth, capsys, cache: Path) -> None:
    everyone = set(truth)
    for pattern in PATTERNS:
        expected = grep_truth(truth, pattern)
        assert set(ls_ids(capsys, str(RUN), "--grep", pattern)) == expected, pattern
        # again, from the cache of decoded text
        assert set(ls_ids(capsys, str(RUN), "--grep", pattern)) == expected, pattern
    hits = [grep_truth(truth, p) for p in PATTERNS]
    assert all(hits) and all(h != everyone for h in hits)
    # a pattern that matches the empty string matches every trajectory, with text or without
    assert set(ls_ids(capsys, str(RUN), "--grep", "q*")) == grep_truth(truth, "q*") == everyone
    assert any(cache.rglob("*.parquet"))
    # the prompt is not searched: a phrase every prompt holds finds nothing
    assert all(PROMPT_ONLY in prompt for _, prompt in truth.values())
    assert ls_ids(capsys, str(RUN), "--grep", PROMPT_ONLY) == []


def test_grep_goes_with_every_selection_option_before_sort_and_limit(truth, capsys) -> None:
    pattern = r"\d+\.\d+"
    chosen = ["--step", "2..3", "--train", "--where", "model_calls >= 1", "--sort", "reward desc, duration_s"]
    ordered = ls_ids(capsys, str(RUN), *chosen)
    expected = [i for i in ordered if i in grep_truth(truth, pattern)]
    assert len(expected) > 2
    assert ls_ids(capsys, str(RUN), *chosen, "--grep", pattern) == expected
    assert ls_ids(capsys, str(RUN), *chosen, "--grep", pattern, "--limit", "2") == expected[:2]
    # the Python API says the same
    from rlreplay.read.open import open_run
    from rlreplay.read.selection import Selection

    selection = Selection(step="2..3", validate=False, grep=pattern, sort="reward desc, duration_s", limit=2)
    assert selection.trajectories(open_run(RUN))["id"].to_pylist() == expected[:2]


def test_the_cache_follows_the_tokenizer_and_the_files(tmp_path: Path, capsys, cache: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    pattern = "error"
    first = set(ls_ids(capsys, str(run), "--grep", pattern))
    assert first == grep_truth(searched_texts(run, run / "tokenizer.json"), pattern)
    # another tokenizer decodes the same ids to other text: searched as that text, not the cached one
    qwen = qwen_tokenizer_dir()
    other = grep_truth(searched_texts(run, qwen / "tokenizer.json"), "the")
    assert set(ls_ids(capsys, str(run), "--grep", "the", "--tokenizer", str(qwen))) == other
    assert set(ls_ids(capsys, str(run), "--grep", "the")) == grep_truth(
        searched_texts(run, run / "tokenizer.json"), "the"
    )
    # a shard rewritten: its step's texts are made again, the old file goes
    step_dirs = [d for d in cache.rglob("step=1") if d.is_dir()]
    before = {p.name for d in step_dirs for p in d.glob("*.parquet")}
    shard = next((run / "spans").glob("step=1/*/*.parquet"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert set(ls_ids(capsys, str(run), "--grep", pattern)) == first
    after = {p.name for d in step_dirs for p in d.glob("*.parquet")}
    assert after and not after & before


def test_export_takes_grep_too(truth, tmp_path: Path, capsys) -> None:
    out = tmp_path / "errors.jsonl"
    assert main(["export", str(RUN), "--grep", "error", "--out", str(out)]) == 0
    assert {json.loads(line)["id"] for line in out.read_text().splitlines()} == grep_truth(truth, "error")


@pytest.mark.parametrize("pattern", ["[a", "", "(?P<x", "a{2,1}"])
def test_a_bad_pattern_is_one_line_exit_2(pattern: str, capsys) -> None:
    capsys.readouterr()
    assert main(["ls", str(RUN), "--grep", pattern]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlreplay: error: --grep") and len(err.strip().splitlines()) == 1


def test_a_run_without_a_tokenizer_says_so(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    manifest = json.loads((run / "run.json").read_text())
    for key in ("tokenizer", "tokenizer_files", "tokenizer_source"):
        manifest.pop(key, None)
    (run / "run.json").write_text(json.dumps(manifest))
    (run / "tokenizer.json").unlink()
    capsys.readouterr()
    assert main(["ls", str(run), "--grep", "error"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer" in err and len(err.strip().splitlines()) == 1
    assert main(["ls", str(run), "--grep", "error", "--tokenizer", str(RUN / "tokenizer.json")]) == 0


def test_a_run_of_agent_spans_alone_is_searched_in_their_responses(tmp_path: Path, capsys) -> None:
    """A loop traced with the generic API that records no model calls: its agent span's response
    ids are the text searched (encoded here from known text)."""
    import asyncio

    from tokenizers import Tokenizer

    import rlreplay

    tok_dir = qwen_tokenizer_dir()
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    answers = ["The answer is 42.", "I could not parse that: error in line 3", "Nothing to see here"]

    @rlreplay.trace_op(name="Loop.run", kind="agent")
    async def run_loop(i: int) -> dict:
        response = tok.encode(answers[i], add_special_tokens=False).ids
        prompt = tok.encode("error in line 7? answer in line 3", add_special_tokens=False).ids
        return {"prompt_ids": prompt, "response_ids": response, "response_mask": [1] * len(response)}

    async def go() -> None:
        for i in range(len(answers)):
            async with rlreplay.trajectory(step=0, sample_index=i, rollout_n=0, name="loop"):
                await run_loop(i)

    run = tmp_path / "run"
    rlreplay.init(run, worker="w0")
    try:
        asyncio.run(go())
    finally:
        rlreplay.close()
    capsys.readouterr()
    assert main(["ls", str(run), "--json"]) == 0
    sample = {
        json.loads(line)["id"]: json.loads(line)["sample_index"]
        for line in capsys.readouterr().out.splitlines()
    }
    for pattern, expected in ((r"error in line \d", {1}), ("(?i)the ANSWER", {0}), ("line 7", set())):
        found = ls_ids(capsys, str(run), "--grep", pattern, "--tokenizer", str(tok_dir))
        assert {sample[i] for i in found} == expected, pattern


def test_a_run_on_an_object_store_is_searched_as_its_folder(truth, tmp_path: Path, monkeypatch) -> None:
    """The run copied onto fsspec's in-memory filesystem (read as an object store is): the same rows."""
    from rlreplay.read.open import open_run
    from rlreplay.read.search import TextSearch
    from rlreplay.read.selection import Selection

    monkeypatch.setenv("RLREPLAY_CACHE", str(tmp_path / "read-cache"))
    uri, remove = memory_store_copy(RUN, tmp_path.name)
    try:
        tokenizer = str(RUN / "tokenizer.json")  # the run's, which the read cache does not fetch
        run = open_run(uri)
        selection = Selection(grep="error", step="1..2")
        got = selection.trajectories(run, texts=TextSearch.for_run(run, tokenizer))
        listed = {r["id"] for r in Selection(step="1..2").trajectories(run).to_pylist()}
        assert set(got["id"].to_pylist()) == grep_truth(truth, "error") & listed
        again = open_run(uri)  # from the kept texts
        assert selection.trajectories(again, texts=TextSearch.for_run(again, tokenizer)).equals(got)
    finally:
        remove()


# ---- many steps: searched in parallel, from kept texts, damaged ones and missing ones ---------------

MANY_STEPS = 24


@pytest.fixture(scope="module")
def many_steps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[list[str], str]]]:
    """The sample run's four steps written again as ``MANY_STEPS`` steps (ids of their own), with its
    manifest and tokenizer; and its searched texts, worked out as ``truth`` is."""
    import synthetic_run

    from rlreplay.read.open import open_run

    run_dir = tmp_path_factory.mktemp("many") / "run"
    run_dir.mkdir()
    for name in ("run.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(RUN / name, run_dir / name)
    sample = open_run(RUN)
    templates = [sample.spans(step=s) for s in (1, 2, 3, 4)]
    for step in range(MANY_STEPS):
        synthetic_run.write_step(run_dir, synthetic_run.as_step(templates[step % 4], step), step)
    return run_dir, searched_texts(run_dir, run_dir / "tokenizer.json")


def searched_mask(run_dir: Path, listing, pattern: str, threads: int) -> list[bool]:
    from rlreplay.read.open import open_run
    from rlreplay.read.search import FLAGS, TextSearch

    search = TextSearch(open_run(run_dir), str(run_dir / "tokenizer.json"), threads=threads)
    return search.matches(listing, FLAGS + pattern).to_pylist()


def test_many_steps_searched_at_once_give_what_one_thread_gives(many_steps, cache: Path) -> None:
    """Steps read and searched on several threads: the same rows, in the listing's order (one
    whose steps interleave), as one thread and as the texts themselves say; from decoding, from
    the kept texts, and with some steps' kept texts gone."""
    from rlreplay.read.open import open_run
    from rlreplay.read.selection import Selection

    run_dir, texts = many_steps
    listing = Selection(sort="reward desc, duration_s").trajectories(open_run(run_dir))
    steps = listing["step"].to_pylist()
    assert len(set(steps)) == MANY_STEPS and steps != sorted(steps)  # the steps interleave
    ids = listing["id"].to_pylist()
    for pattern in (*PATTERNS, "q*"):
        expected = [i in grep_truth(texts, pattern) for i in ids]
        assert sum(expected) > 0, pattern
        for threads in (4, 1, 3):  # the first decodes every step, the others read the kept texts
            assert searched_mask(run_dir, listing, pattern, threads) == expected, (pattern, threads)
    kept = sorted(cache.rglob("*.parquet"))
    assert len(kept) == MANY_STEPS
    for path in kept[::3]:
        path.unlink()
    expected = [i in grep_truth(texts, "error") for i in ids]
    assert searched_mask(run_dir, listing, "error", 4) == expected
    assert len(sorted(cache.rglob("*.parquet"))) == MANY_STEPS  # made again


def test_a_damaged_kept_text_file_is_decoded_again(many_steps, cache: Path) -> None:
    """Kept texts whose bytes changed (a flipped byte in the texts, in the footer, a cut file, other
    bytes entirely) are not searched: their steps are decoded again, and their files made anew."""
    from rlreplay.format import checksums
    from rlreplay.read.open import open_run
    from rlreplay.read.selection import Selection

    run_dir, texts = many_steps
    listing = Selection().trajectories(open_run(run_dir))
    ids = listing["id"].to_pylist()
    pattern = r"\d+\.\d+"
    expected = [i in grep_truth(texts, pattern) for i in ids]
    assert searched_mask(run_dir, listing, pattern, 4) == expected
    kept = sorted(cache.rglob("*.parquet"))
    data = {path: path.read_bytes() for path in kept}
    damaged = kept[1:9:2]
    first, footer, cut, other = damaged
    flipped = bytearray(data[first])
    flipped[len(flipped) // 3] ^= 0x20
    first.write_bytes(bytes(flipped))
    flipped = bytearray(data[footer])
    flipped[-12] ^= 0x01
    footer.write_bytes(bytes(flipped))
    cut.write_bytes(data[cut][: len(data[cut]) // 2])
    other.write_bytes(b"PAR1" + os.urandom(200) + b"PAR1")
    for path in damaged:
        with pytest.raises((OSError, ValueError)):
            checksums.read_table(path)
    for threads in (4, 1):
        assert searched_mask(run_dir, listing, pattern, threads) == expected
        assert searched_mask(run_dir, listing, "q*", threads) == [True] * len(ids)
    assert sorted(cache.rglob("*.parquet")) == kept  # each step's file made anew where it was
    for path in damaged:
        assert checksums.read_table(path).num_rows > 0  # the step's texts kept again, whole


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(st.integers(-3, 40), st.sampled_from([None, "warmup", "7", ""])), min_size=0, max_size=60
    )
)
def test_step_rows_groups_the_rows_of_each_step_in_first_seen_order(steps: list) -> None:
    """A listing's rows by step (an integer step, else the step as recorded as a string), the steps
    in the order their first row comes, each step's rows ascending."""
    import pyarrow as pa

    from rlreplay.read.scan import step_rows

    listing = pa.table(
        {
            "id": [f"t{i}" for i in range(len(steps))],
            "step": pa.array([s if isinstance(s, int) else None for s in steps], pa.int64()),
            "step_str": pa.array([s if isinstance(s, str) else None for s in steps], pa.string()),
        }
    )
    expected: dict = {}
    for row, step in enumerate(steps):
        expected.setdefault(("int", step) if isinstance(step, int) else ("str", step), []).append(row)
    got = [
        (("int", step) if isinstance(step, int) else ("str", step), rows.tolist())
        for step, rows in step_rows(listing)
    ]
    assert got == list(expected.items())
