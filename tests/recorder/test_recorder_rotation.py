"""A step that never ends (verl's fully-async step -1, a long validation) never grows one live file:
live files rotate by size and age and are sealed on the sealing thread while recording goes on; a
finished step is sealed once idle, without waiting for the next one; spilled spans are batched; the
queue cap counts what queued spans keep alive."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq

import rlreplay
from rlreplay.recorder.api import get_recorder
from rlreplay.recorder.events import payload_bytes
from rlreplay.shards.layout import list_files
from rlreplay.shards.live import read_partial


@rlreplay.trace_op(kind="llm")
def generate(prompt_ids: list[int]) -> dict:
    return {"token_ids": prompt_ids[::-1]}


def test_never_ending_step_rotates_live_files_by_size(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w0")
    recorder = get_recorder()
    assert recorder is not None
    recorder.config.max_partial_bytes = 256 << 10
    made = 0
    for i in range(300):
        with rlreplay.trajectory(step=-1, sample_index=i % 7, rollout_n=i):
            generate(list(range(i, i + 2000)))
        made += 2
        if i % 25 == 24:
            rlreplay.flush()
    sealed, partials = list_files(run_dir, step=-1)
    assert len(sealed) >= 4 and len(partials) <= 1  # sealed while the step is still recording
    for path in sealed:
        meta = pq.ParquetFile(path).metadata
        assert meta.num_rows > 0
    for partial in partials:
        assert read_partial(partial).table.nbytes < 2 * recorder.config.max_partial_bytes
    rlreplay.close()
    run = rlreplay.open_run(run_dir)
    table = run.spans(step=-1, columns=["rollout_n", "kind"])
    assert table.num_rows == made
    assert sorted(set(table["rollout_n"].to_pylist())) == list(range(300))
    assert list_files(run_dir)[1] == []


def test_live_file_rotates_by_age_and_idle_step_is_sealed_without_a_next_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w0")
    recorder = get_recorder()
    assert recorder is not None
    recorder.config.max_partial_age_s = 0.3
    recorder.config.seal_idle_s = 60
    with rlreplay.trajectory(step=-1, sample_index=0):
        generate([1, 2, 3])
    rlreplay.flush()
    time.sleep(0.4)
    with rlreplay.trajectory(step=-1, sample_index=1):
        generate([4, 5])
    rlreplay.flush()
    sealed, _ = list_files(run_dir, step=-1)
    assert len(sealed) == 1  # the old file, rotated by age at the next write

    recorder.config.seal_idle_s = 0.3
    with rlreplay.trajectory(step=3, sample_index=0):
        generate([1])
    rlreplay.flush()
    deadline = time.monotonic() + 10
    while list_files(run_dir, step=3)[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    sealed, partials = list_files(run_dir, step=3)
    assert len(sealed) == 1 and partials == []  # no step 4 ever began
    rlreplay.close()
    assert rlreplay.open_run(run_dir).spans().num_rows == 6


def test_spilled_spans_are_written_in_batches(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rlreplay.init(run_dir, worker="w0", policy="spill", max_queue_mb=64 / 1024)
    recorder = get_recorder()
    assert recorder is not None
    recorder._wake.wait = lambda timeout=None: time.sleep(0.05) or False  # a slow writer
    for i in range(600):
        with rlreplay.trajectory(step=0, sample_index=i):
            generate(list(range(300)))
    # every span in a live file (how many batches the slow writer wrote meanwhile depends on timing)
    assert rlreplay.flush()
    stats = dict(recorder.counters)
    batches = rows = 0
    for partial in list_files(run_dir, step=0)[1]:
        contents = read_partial(partial)
        batches += contents.batches
        rows += contents.table.num_rows
    rlreplay.close()
    assert stats["spilled"] > 100 and rows == 1200
    assert batches * 8 < rows  # not one batch per spilled span
    assert rlreplay.open_run(run_dir).spans().num_rows == 1200


def test_queue_cap_counts_token_lists_inside_results() -> None:
    ids = list(range(10_000))
    assert payload_bytes((), {}, {"token_ids": ids}) >= 10_000 * 36  # kept ints, not just pointers
    assert payload_bytes((ids,), {}, None) >= 10_000 * 36


def test_queue_cap_looks_into_objects_not_into_plain_values() -> None:
    class Output:
        def __init__(self, ids: list[int]) -> None:
            self.token_ids = ids

    class TaggedInt(int):  # a subclass may carry fields of its own
        pass

    ids = list(range(10_000))
    tagged = TaggedInt(7)
    tagged.token_ids = ids  # type: ignore[attr-defined]
    empty = payload_bytes((), {}, None)
    for plain in (7, 0.5, "text", True, b"x", (1, 2)):
        assert payload_bytes((), {}, plain) == empty
    assert payload_bytes((), {}, Output(ids)) >= empty + 10_000 * 36
    assert payload_bytes((), {}, tagged) >= empty + 10_000 * 36
