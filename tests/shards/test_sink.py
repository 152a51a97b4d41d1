"""The recorder's sink on its own: batches go to one live file per step, files rotate by size and age
and are sealed on the sealing thread; a refused batch, a removed file come back as results."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlreplay.format import manifest
from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.shards.layout import list_files, partition_dir
from rlreplay.shards.live import read_partial
from rlreplay.shards.sink import Export, GoneFile, ShardSink


@dataclass
class Limits:
    max_partial_bytes: int = 1 << 30
    max_partial_age_s: float = 3600.0


def batch(step: int, first: int, n: int) -> pa.RecordBatch:
    """``n`` spans of ``step`` with span ids ``first``..``first + n - 1``."""
    rows = [
        {"trajectory_id": f"{i // 4:032x}", "span_id": f"{i:016x}", "name": "op", "kind": "op",
         "start_ns": i, "end_ns": i + 1, "status": "ok", "step": step, "sample_index": i // 4,
         "worker": "w0", "inputs": '{"prompt_ids": [' + ",".join(map(str, range(i, i + 50))) + "]}"}
        for i in range(first, first + n)
    ]  # fmt: skip
    return pa.RecordBatch.from_pylist(rows, schema=SPAN_SCHEMA)


class Sink:
    """A ShardSink in a fresh run, with what it warned and how many files it sealed."""

    def __init__(self, run_dir: Path, limits: Limits | None = None) -> None:
        manifest.ensure_manifest(run_dir, "sink")
        self.run_dir = run_dir
        self.limits = limits or Limits()
        self.warnings: list[str] = []
        self.sealed = 0
        self.sink = ShardSink(run_dir, self.limits, lambda: "w0", self._warn, self._on_sealed)

    def _warn(self, key: str, message: str) -> None:
        self.warnings.append(message)

    def _on_sealed(self) -> None:
        self.sealed += 1


def span_ids(path: Path) -> list[str]:
    return sorted(pq.read_table(path, columns=["span_id"])["span_id"].to_pylist())


def ids(first: int, n: int) -> list[str]:
    return [f"{i:016x}" for i in range(first, first + n)]


def test_batches_go_to_a_live_file_per_step_sealed_when_the_step_finishes(tmp_path: Path) -> None:
    s = Sink(tmp_path / "run")
    sink = s.sink
    assert sink.export(0, batch(0, 0, 8)) == Export(8)
    assert sink.export(1, batch(1, 100, 4)) == Export(4)
    assert sink.export(0, batch(0, 8, 8)) == Export(8)
    assert sink.fsync() == []
    (live0,) = list_files(s.run_dir, step=0)[1]
    assert live0.parent == partition_dir(s.run_dir, 0, "w0")
    contents = read_partial(live0)
    assert contents.batches == 2  # still open, and readable batch by batch
    assert sorted(contents.table["span_id"].to_pylist()) == ids(0, 16)

    assert sink.finish(0) is None
    assert sink.force_flush(30)
    (sealed0,), partials0 = list_files(s.run_dir, step=0)
    assert partials0 == [] and span_ids(sealed0) == ids(0, 16)
    assert s.sealed == 1
    assert list_files(s.run_dir, step=1)[0] == []  # step 1 goes on

    assert sink.finish_all() == []
    sink.shutdown(30)
    (sealed1,), partials1 = list_files(s.run_dir, step=1)
    assert partials1 == [] and span_ids(sealed1) == ids(100, 4)
    assert s.sealed == 2 and s.warnings == []


def test_live_files_rotate_by_size_and_by_age_read_at_each_write(tmp_path: Path) -> None:
    s = Sink(tmp_path / "run")
    sink = s.sink
    assert sink.export(-1, batch(-1, 0, 4)) == Export(4)
    s.limits.max_partial_bytes = 1  # the recorder's config changed: the next write rotates
    assert sink.export(-1, batch(-1, 4, 4)) == Export(4, rotated=True)
    assert sink.export(-1, batch(-1, 8, 4)) == Export(4, rotated=True)
    s.limits.max_partial_bytes = 1 << 30
    s.limits.max_partial_age_s = 0.0
    assert sink.export(-1, batch(-1, 12, 4)) == Export(4, rotated=True)
    s.limits.max_partial_age_s = 3600.0
    assert sink.export(-1, batch(-1, 16, 4)) == Export(4)
    assert sink.force_flush(30)
    sealed, (live,) = list_files(s.run_dir, step=-1)
    assert sorted(span_ids(p) for p in sealed) == [ids(0, 8), ids(8, 4), ids(12, 4)]
    assert read_partial(live).table["span_id"].to_pylist() == ids(16, 4)
    sink.finish_all()
    sink.shutdown(30)
    assert len(list_files(s.run_dir, step=-1)[0]) == 4 and s.sealed == 4


def test_a_batch_the_file_refuses_is_lost_and_the_file_given_up(tmp_path: Path) -> None:
    s = Sink(tmp_path / "run")
    sink = s.sink
    refused = pa.record_batch({"x": [1, 2]})  # not the span schema: the stream writer raises
    result = sink.export(3, refused)
    assert result.rows == 0 and isinstance(result.error, pa.ArrowInvalid) and not result.rotated
    assert list_files(s.run_dir, step=3) == ([], [])  # a file nothing reached is removed at once

    assert sink.export(0, batch(0, 0, 4)) == Export(4)
    (first,) = list_files(s.run_dir, step=0)[1]
    result = sink.export(0, refused)
    assert result.rows == 0 and isinstance(result.error, pa.ArrowInvalid)
    assert sink.fsync() == []  # given up: no longer the step's file
    assert sink.export(0, batch(0, 4, 4)) == Export(4)  # into a new file
    sealed, partials = list_files(s.run_dir, step=0)
    assert sealed == [] and len(partials) == 2 and first in partials
    assert sink.finish(0) is None
    assert sink.finish_all() == []  # the given-up file is sealed too: what reached it is kept
    sink.shutdown(30)
    sealed, partials = list_files(s.run_dir, step=0)
    assert partials == [] and sorted(span_ids(p) for p in sealed) == [ids(0, 4), ids(4, 4)]


def test_a_live_file_removed_under_the_sink_comes_back_as_gone(tmp_path: Path) -> None:
    s = Sink(tmp_path / "run")
    sink = s.sink
    sink.export(0, batch(0, 0, 4))
    sink.export(0, batch(0, 4, 2))
    (live,) = list_files(s.run_dir, step=0)[1]
    live.unlink()
    assert sink.fsync() == [GoneFile(0, live, 6)]
    assert sink.fsync() == [] and sink.finish(0) is None  # let go once reported
    assert sink.export(0, batch(0, 6, 3)) == Export(3)
    (again,) = list_files(s.run_dir, step=0)[1]
    again.unlink()
    assert sink.finish(0) == GoneFile(0, again, 3)
    sink.shutdown(30)
    assert list_files(s.run_dir) == ([], []) and s.sealed == 0 and s.warnings == []


def test_freed_memory_goes_back_once_sealing_is_idle_not_after_each_seal(tmp_path: Path) -> None:
    """Given back after every seal, a run of seals faults the same pages in again, zeroed, each time."""
    run_dir = tmp_path / "run"
    manifest.ensure_manifest(run_dir, "sink")
    released: list[float] = []
    idle = 1.5
    sink = ShardSink(
        run_dir, Limits(), lambda: "w0", lambda key, message: None,
        release_memory=lambda: released.append(time.monotonic()), release_idle_s=idle,
    )  # fmt: skip

    def burst(steps: range) -> float:
        for step in steps:
            assert sink.export(step, batch(step, 100 * step, 4)) == Export(4)
        started = time.monotonic()
        for step in steps:
            assert sink.finish(step) is None
        assert sink.force_flush(30)
        return started

    def wait_released(count: int) -> None:
        deadline = time.monotonic() + 30
        while len(released) < count and time.monotonic() < deadline:
            time.sleep(0.05)

    first = burst(range(3))
    assert len(list_files(run_dir)[0]) == 3
    assert released == []  # three seals, nothing given back between them
    wait_released(1)
    assert len(released) == 1 and released[0] - first >= idle

    second = burst(range(3, 5))  # sealing again after memory went back: it goes back again
    wait_released(2)
    assert len(released) == 2 and released[1] - second >= idle

    sink.finish_all()
    sink.shutdown(30)
    time.sleep(0.1)
    assert len(released) == 2  # nothing sealed since: nothing more to give back
