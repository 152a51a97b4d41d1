"""`rlreplay recover` on damaged live files: it keeps every readable batch, moves what it cannot read
to RUN/_quarantine/ (never deletes it), says exactly what it kept and set aside, and never writes or
deletes outside the run directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rlreplay
from rlreplay.cli.main import main
from rlreplay.format import manifest
from rlreplay.format.schema import FORMAT_KEY, SPAN_SCHEMA
from rlreplay.shards.layout import list_files, partition_dir, sealed_path_for
from rlreplay.shards.live import PartialWriter

ROWS = 20


def _batch(b: int, step: int) -> pa.RecordBatch:
    rows = [
        {
            "trajectory_id": f"{b:032x}",
            "span_id": f"{b * 100 + i:016x}",
            "name": "op",
            "kind": "op",
            "start_ns": i,
            "end_ns": i + 1,
            "status": "ok",
            "step": step,
            "sample_index": b,
            "rollout_n": i,
            "validate": False,
            "worker": "w0",
            "inputs": '{"prompt_ids": [' + ",".join(str(x) for x in range(b, b + 200)) + "]}",
        }
        for i in range(ROWS)
    ]
    return pa.RecordBatch.from_pylist(rows, schema=SPAN_SCHEMA)


def _partial(run_dir: Path, step: int = 7, batches: int = 10, worker: str = "w0") -> tuple[Path, list[int]]:
    """A dead writer's partial (no end-of-stream marker) and the byte offset where each batch starts."""
    manifest.ensure_manifest(run_dir, "damaged")
    writer = PartialWriter(partition_dir(run_dir, step, worker))
    offsets = []  # offsets[0] is 0: the stream header is written with the first batch
    for b in range(batches):
        offsets.append(writer.path.stat().st_size)
        writer.write(_batch(b, step))
    end = writer.path.stat().st_size
    writer.close()
    data = writer.path.read_bytes()[:end]  # as a SIGKILL leaves it: no end marker
    writer.path.write_bytes(data)
    return writer.path, [*offsets, end]


def _recover(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["recover", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return " ".join(out.split())


def _quarantined(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "_quarantine").rglob("*") if p.is_file())


def test_garbage_in_the_middle_keeps_every_batch_around_it(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    partial, offsets = _partial(run_dir)
    data = bytearray(partial.read_bytes())
    garbage = b"\x00junk\xff" * 50
    # batch 5 is overwritten in its middle; 300 bytes of garbage are inserted after batch 2
    mid = (offsets[5] + offsets[6]) // 2
    data[mid : mid + 64] = b"\x5a" * 64
    data[offsets[3] : offsets[3]] = garbage
    partial.write_bytes(bytes(data))

    out = _recover(run_dir, capsys)
    sealed, partials = list_files(run_dir)
    assert partials == [] and len(sealed) == 1
    kept = pq.read_table(sealed[0])
    assert sorted(set(kept["sample_index"].to_pylist())) == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert kept.num_rows == 9 * ROWS
    assert f"kept {9 * ROWS} spans" in out and "recovered 1 shard (" in out
    # the unreadable bytes are kept, byte for byte, and reported
    aside = _quarantined(run_dir)
    assert len(aside) == 2 and "set aside 2 files" in out
    assert aside[0].read_bytes().startswith(garbage) or aside[1].read_bytes().startswith(garbage)
    assert sum(p.stat().st_size for p in aside) == len(garbage) + (offsets[6] - offsets[5])
    recorded = json.loads((run_dir / "run.json").read_text())
    assert recorded["recovered_spans"] == 9 * ROWS and recorded["quarantined_files"] == 2


def test_one_flipped_byte_in_a_batch_sets_that_batch_aside(tmp_path: Path, capsys) -> None:
    """A single changed byte inside a batch (a bad sector, a stray write) never reads back as other
    values: the batch is set aside and every other batch is kept."""
    for n, where in enumerate((0.3, 0.5, 0.8)):
        run_dir = tmp_path / f"run{n}"
        partial, offsets = _partial(run_dir)
        data = bytearray(partial.read_bytes())
        pos = offsets[5] + int((offsets[6] - offsets[5]) * where)
        data[pos] ^= 0x04
        partial.write_bytes(bytes(data))
        out = _recover(run_dir, capsys)
        (sealed,) = list_files(run_dir)[0]
        kept = pq.read_table(sealed)
        assert sorted(set(kept["sample_index"].to_pylist())) == [0, 1, 2, 3, 4, 6, 7, 8, 9], where
        assert kept.num_rows == 9 * ROWS
        assert f"kept {9 * ROWS} spans" in out
        aside = _quarantined(run_dir)
        assert len(aside) == 1 and aside[0].stat().st_size == offsets[6] - offsets[5]


def test_bad_first_batch_keeps_the_rest(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    partial, offsets = _partial(run_dir, batches=5)
    data = bytearray(partial.read_bytes())
    length = offsets[2] - offsets[1]  # the first batch is as long, after the stream header
    data[offsets[1] - length // 2 : offsets[1] - 10] = b"\x00" * (length // 2 - 10)
    partial.write_bytes(bytes(data))
    out = _recover(run_dir, capsys)
    (sealed,) = list_files(run_dir)[0]
    assert pq.read_table(sealed).num_rows == 4 * ROWS
    assert "torn" not in out and "1 unreadable byte range" in out


def test_torn_tail_is_set_aside_not_deleted(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    partial, offsets = _partial(run_dir, batches=3)
    data = partial.read_bytes()
    partial.write_bytes(data[: offsets[3] - 50])
    out = _recover(run_dir, capsys)
    (sealed,) = list_files(run_dir)[0]
    assert pq.read_table(sealed).num_rows == 2 * ROWS
    (aside,) = _quarantined(run_dir)
    assert aside.read_bytes() == data[offsets[2] : offsets[3] - 50]
    assert "torn tail" in out


def test_junk_parquet_beside_a_partial_is_set_aside_and_the_partial_sealed(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    partial, _ = _partial(run_dir, batches=4)
    junk = sealed_path_for(partial)
    junk.write_bytes(b"PAR1 not really")
    out = _recover(run_dir, capsys)
    assert not partial.exists()
    assert pq.read_table(junk).num_rows == 4 * ROWS  # now the real sealed file
    (aside,) = _quarantined(run_dir)
    assert aside.read_bytes() == b"PAR1 not really" and aside.name == junk.name
    assert "foreign or corrupt" in out


def test_partial_already_sealed_is_removed_only_when_every_row_is_in_its_sealed_file(
    tmp_path: Path, capsys
) -> None:
    run_dir = tmp_path / "run"
    partial, _ = _partial(run_dir, batches=3)
    copy = partial.read_bytes()
    _recover(run_dir, capsys)
    (sealed,) = list_files(run_dir)[0]
    partial.write_bytes(copy)  # a crash between the rename and the partial's removal
    assert "already sealed" in _recover(run_dir, capsys)
    assert not partial.exists() and pq.read_table(sealed).num_rows == 3 * ROWS
    # a partial holding other rows under that name is never dropped
    partial.write_bytes(copy[: len(copy) // 2])
    _recover(run_dir, capsys)
    assert not partial.exists() and any(p.name == partial.name for p in _quarantined(run_dir))


@pytest.mark.parametrize("version", [b"abc", b"1.5", b""])
def test_partial_with_a_bad_format_version_does_not_stop_the_run(
    tmp_path: Path, version: bytes, capsys
) -> None:
    run_dir = tmp_path / "run"
    good, _ = _partial(run_dir, step=1, batches=2)
    bad_dir = partition_dir(run_dir, 2, "w9")
    bad_dir.mkdir(parents=True)
    bad = bad_dir / "_part-bad.partial"
    schema = SPAN_SCHEMA.with_metadata({FORMAT_KEY: version})
    with pa.OSFile(str(bad), "wb") as f, pa.ipc.new_stream(f, schema) as w:
        w.write_batch(pa.RecordBatch.from_arrays(_batch(0, 2).columns, schema=schema))
    capsys.readouterr()
    assert main(["ls", str(run_dir), "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and "_part-bad.partial" in err and "Traceback" not in err
    out = _recover(run_dir, capsys)
    assert "recovered 1 shard (" in out and "_part-bad.partial" in out
    assert not bad.exists() and [p.name for p in _quarantined(run_dir)] == ["_part-bad.partial"]
    assert rlreplay.open_run(run_dir).spans().num_rows == 2 * ROWS
    assert not good.exists()


def test_recover_never_writes_or_deletes_outside_the_run(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    _partial(run_dir, step=1, batches=2)
    outside = tmp_path / "outside"
    outside_partial, _ = _partial(outside, step=13, batches=2)
    (run_dir / "spans" / "step=13").symlink_to(outside / "spans" / "step=13")
    before = sorted(p.name for p in outside.rglob("*"))
    out = _recover(run_dir, capsys)
    assert "recovered 1 shard (" in out and "outside the run" in out
    assert outside_partial.exists() and sorted(p.name for p in outside.rglob("*")) == before

    # a quarantine folder that points elsewhere is not used either: the damaged file stays put
    run2 = tmp_path / "run2"
    partial, _ = _partial(run2, batches=2)
    partial.write_bytes(b"\x00garbage" * 20)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run2 / "_quarantine").symlink_to(elsewhere)
    out = _recover(run2, capsys)
    assert partial.exists() and list(elsewhere.iterdir()) == [] and "left alone" in out


def test_recorder_never_writes_through_a_symlinked_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    outside = tmp_path / "outside"
    outside.mkdir()
    (run_dir / "spans").mkdir(parents=True)
    (run_dir / "spans" / "step=13").symlink_to(outside)
    rlreplay.init(run_dir, worker="w0")

    @rlreplay.trace_op
    def op(x: int) -> int:
        return x + 1

    for step in (12, 13):
        with rlreplay.trajectory(step=step):
            op(1)
    rlreplay.flush()
    stats = rlreplay.stats()
    rlreplay.close()
    assert list(outside.iterdir()) == []
    assert stats["spans"] == 2 and stats["lost"] == 2
    assert rlreplay.open_run(run_dir).spans().num_rows == 2


def test_recover_reads_a_format_1_live_file(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "v1-run"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "v1-run", run_dir)
    before = rlreplay.open_run(run_dir).trajectories().num_rows
    out = _recover(run_dir, capsys)
    assert "recovered 1 shard (" in out and list_files(run_dir)[1] == []
    assert rlreplay.open_run(run_dir).trajectories().num_rows == before > 0


def test_an_empty_live_file_is_read_as_empty_and_recover_removes_it(tmp_path: Path, capsys) -> None:
    """A live file a writer created but never wrote to (it just opened it, or the disk was full)
    holds nothing: listings read it as empty with no warning, and ``recover`` removes it (nothing
    to set aside) instead of moving it to RUN/_quarantine/."""
    run_dir = tmp_path / "run"
    path, _ = _partial(run_dir, step=7, batches=3)
    empty = partition_dir(run_dir, 8, "w1") / "_part-18eb000000000000-1-abcdef.partial"
    empty.parent.mkdir(parents=True)
    empty.touch()
    run = rlreplay.open_run(run_dir)
    assert run.trajectories()["id"].to_pylist() == [f"{b:032x}" for b in range(3)]
    assert run.warnings == []
    out = _recover(run_dir, capsys)
    assert not empty.exists() and _quarantined(run_dir) == []
    assert f"{empty.relative_to(run_dir)}: removed (empty)" in out
    assert sealed_path_for(path).exists()
