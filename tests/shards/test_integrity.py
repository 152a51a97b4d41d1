"""Checksums in every span file, verified on every read: a file with a changed byte reads back
exactly as written, or it is refused and named; never as other values. ``recover`` sets aside what
the checksums reject and seals again what still matches them."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlreplay.cli.main import main
from rlreplay.format import index as tindex
from rlreplay.format import manifest
from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.read.run import Run
from rlreplay.shards.layout import list_files, partition_dir
from rlreplay.shards.live import PartialWriter
from rlreplay.shards.seal import ROW_GROUP_BYTES, seal

STEP = 3


def _rows(
    first: int, count: int, ids_per_span: int = 12, rng: np.random.Generator | None = None
) -> list[dict]:
    """Spans of ``count`` trajectories: a root and a model call with token ids, a mask and
    log-probs, rewards on some, an error on some, nulls in between (the encodings a shard uses)."""
    rng = rng or np.random.default_rng(first)
    rows = []
    for t in range(first, first + count):
        ids = rng.integers(0, 150_000, ids_per_span).tolist()
        same = {
            "trajectory_id": f"{t:032x}",
            "worker": "w0",
            "experiment": "integrity",
            "validate": t % 4 == 0,
            "step": STEP,
            "sample_index": t // 2,
            "rollout_n": t % 2,
        }
        root = {"span_id": f"{t:08x}00000000", "name": "agent_loop", "kind": "trajectory"}
        rows.append(
            {
                **same,
                **root,
                "start_ns": 1_000 * t,
                "end_ns": 1_000 * t + 900,
                "status": "error" if t % 3 == 2 else "ok",
                "error": "ValueError: boom" if t % 3 == 2 else None,
                "reward": None if t % 3 == 1 else t / 10,
                "attributes": json.dumps({"who": f"t{t}"}),
            }
        )
        rows.append(
            {
                **same,
                "span_id": f"{t:08x}00000001",
                "parent_id": root["span_id"],
                "name": "generate",
                "kind": "llm",
                "start_ns": 1_000 * t + 100,
                "end_ns": 1_000 * t + 800,
                "status": "ok",
                "num_tokens": ids_per_span,
                "inputs": json.dumps({"prompt": f"question {t}"}),
                "output": json.dumps({"token_ids": {"__type__": "tokens", "dtype": "int32", "n": len(ids)}}),
                "token_ids": ids,
                "token_masks": [1, 0] * (ids_per_span // 2),
                "token_logprobs": (-rng.random(ids_per_span)).astype(np.float32).tolist(),
            }
        )
    return rows


def _live_file(run_dir: Path, batches: int = 3, per_batch: int = 2, ids_per_span: int = 12) -> Path:
    """A closed live file (whole, with its end-of-stream marker) of ``batches`` batches."""
    manifest.ensure_manifest(run_dir, "integrity")
    writer = PartialWriter(partition_dir(run_dir, STEP, "w0"))
    for b in range(batches):
        rows = _rows(b * per_batch, per_batch, ids_per_span)
        writer.write(pa.RecordBatch.from_pylist(rows, schema=SPAN_SCHEMA))
    writer.close()
    return writer.path


def _sealed_run(run_dir: Path, **kw: int) -> Path:
    """A run with one sealed shard, sealed as the recorder seals its live files."""
    result = seal(_live_file(run_dir, **kw))
    assert result.sealed is not None
    return result.sealed


def _flipped(path: Path, original: bytes, at: int, xor: int) -> None:
    data = bytearray(original)
    data[at] ^= xor
    path.write_bytes(bytes(data))


def _write_byte(path: Path, at: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([value]))


@contextlib.contextmanager
def _flipped_while(path: Path, original: bytes, at: int, xor: int) -> Iterator[None]:
    """``path`` holds ``original`` with the byte at ``at`` XORed with ``xor`` while the block runs
    (the same bytes :func:`_flipped` writes, changed in place: the byte-by-byte loops rewrite one
    byte, not the whole file, each time); it holds ``original`` again after, whatever the block
    did to it."""
    assert path.stat().st_size == len(original)
    _write_byte(path, at, original[at] ^ xor)
    try:
        yield
    finally:
        if path.exists() and path.stat().st_size == len(original):
            _write_byte(path, at, original[at])
        if not path.exists() or path.read_bytes() != original:  # the block rewrote it: all of it back
            path.write_bytes(original)


def _read_or_refuse(run_dir: Path, rel: str, expected: pa.Table, columns: list[str] | None = None) -> str:
    """Read the run's spans: exactly ``expected``, or nothing of the file with a warning naming it."""
    run = Run(run_dir)
    table = run.spans(columns=columns)
    if not run.warnings:
        assert table.equals(expected), "a changed byte read back as other values"
        return "identical"
    assert any(rel in w for w in run.warnings), run.warnings
    assert table.num_rows == 0, "rows of a refused file were returned"
    assert rel in run.unreadable and run.incomplete() is not None
    return "refused"


def test_every_byte_of_a_sealed_shard_reads_back_identical_or_is_refused(tmp_path: Path) -> None:
    """A shard of 3 trajectories, one a batch: each kind of row of :func:`_rows` (an error, a null
    reward, a reward, both validate values), in the encodings and pages of a larger shard."""
    run_dir = tmp_path / "run"
    shard = _sealed_run(run_dir, batches=3, per_batch=1, ids_per_span=4)
    rel = shard.relative_to(run_dir).as_posix()
    original = shard.read_bytes()
    expected = Run(run_dir).spans()
    assert expected.num_rows == 6 and Run(run_dir).spans().equals(expected)
    assert sorted(expected["status"].to_pylist()) == ["error", *["ok"] * 5]
    assert sorted(expected["validate"].to_pylist()) == [False, False, False, False, True, True]
    meta = ["trajectory_id", "span_id", "step", "status"]
    expected_meta = Run(run_dir).spans(columns=meta)
    outcomes = {"identical": 0, "refused": 0}
    for at in range(len(original)):
        with _flipped_while(shard, original, at, 0xFF):
            outcomes[_read_or_refuse(run_dir, rel, expected)] += 1
            if at % 7 == 0:  # reads of a few columns check only those columns' chunks
                _read_or_refuse(run_dir, rel, expected_meta, meta)
    # only the leading magic number (never read) and the key naming the checksums (then the file
    # reads as written before checksums, and its bytes are as written) can change unnoticed
    assert outcomes["identical"] <= 4 + len(b"rlreplay.crc32"), outcomes
    shard.write_bytes(original)
    run = Run(run_dir)
    assert run.spans().equals(expected) and not run.warnings and not run.unverified


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_changed_bytes_read_back_identical_or_are_refused(tmp_path_factory, data) -> None:
    """Any byte values, one or several bytes at once, anywhere in the file (the class, not one XOR)."""
    base = tmp_path_factory.getbasetemp() / "any-bytes"
    if not base.exists():
        _sealed_run(base / "run")
    run_dir = base / "run"
    (shard,) = list_files(run_dir)[0]
    backup = base / "original.parquet"
    if not backup.exists():
        shutil.copyfile(shard, backup)
    original = backup.read_bytes()
    data_bytes = bytearray(original)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(original) - 1))
        data_bytes[at] = data.draw(st.integers(0, 255))
    shard.write_bytes(original)
    expected = Run(run_dir).spans()
    shard.write_bytes(bytes(data_bytes))
    try:
        _read_or_refuse(run_dir, shard.relative_to(run_dir).as_posix(), expected)
    finally:
        shard.write_bytes(original)


def test_every_byte_of_a_shard_index_lists_identical_or_is_rebuilt_from_the_shard(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shard = _sealed_run(run_dir)
    sidecar = tindex.index_path(shard)
    original = sidecar.read_bytes()
    expected = Run(run_dir).trajectories()
    for at in range(0, len(original), 3):  # every third byte: each read rebuilds from the shard
        with _flipped_while(sidecar, original, at, 0xFF):
            run = Run(run_dir)
            assert run.trajectories().equals(expected), at  # a damaged index is rebuilt from its shard
            assert not run.warnings


def test_every_byte_of_a_live_file_reads_back_as_written_or_the_file_is_named(tmp_path: Path) -> None:
    """A live file no writer holds: a changed byte gives back the file's batches as written, or
    only its first whole batches with a warning naming it, or the file refused and named."""
    run_dir = tmp_path / "run"
    live = _live_file(run_dir, per_batch=1, ids_per_span=4)
    rel = live.relative_to(run_dir).as_posix()
    original = live.read_bytes()
    expected = Run(run_dir).spans()
    assert expected.num_rows == 6
    for at in range(len(original)):
        with _flipped_while(live, original, at, 0xFF if at % 2 else 0x01):
            run = Run(run_dir)
            table = run.spans()
        if not run.warnings:
            assert table.equals(expected), at
            continue
        assert any(rel in w for w in run.warnings), (at, run.warnings)
        assert table.equals(expected.slice(0, table.num_rows)), at  # whole batches, as written
        assert rel in run.unreadable, at


def test_files_written_before_checksums_still_read_and_info_says_they_are_unverified(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fixture = Path(__file__).parents[1] / "fixtures" / "v2-early-run"
    run = Run(fixture)
    spans = run.spans()
    sealed = list_files(fixture)[0]
    assert spans.num_rows > 0 and not run.warnings
    assert run.unverified == {p.relative_to(fixture).as_posix() for p in sealed}
    assert main(["info", str(fixture), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["unverified_files"] == len(sealed) and info["unreadable_files"] == 0


def test_sealed_shards_carry_page_checksums_too(tmp_path: Path) -> None:
    """Parquet's own page CRCs are written as well, for other readers (pyarrow verifies them)."""
    shard = _sealed_run(tmp_path / "run")
    table = pq.read_table(shard, page_checksum_verification=True)
    assert table.num_rows == 12
    data = bytearray(shard.read_bytes())
    pf = pq.ParquetFile(shard)
    column = pf.metadata.row_group(0).column(SPAN_SCHEMA.get_field_index("start_ns"))
    data[column.data_page_offset + column.total_compressed_size - 3] ^= 0xFF  # in its page data
    shard.write_bytes(bytes(data))
    with pytest.raises(OSError, match="CRC"):
        pq.read_table(shard, columns=["start_ns"], page_checksum_verification=True)


def _row_groups_run(run_dir: Path) -> Path:
    """A shard of 3 row groups (3 trajectories each: a span holds ~5/12 of a row group's bytes, 9
    bytes per token: id, mask and log-prob)."""
    manifest.ensure_manifest(run_dir, "integrity")
    writer = PartialWriter(partition_dir(run_dir, STEP, "w0"))
    rows = [r for r in _rows(0, 9, ids_per_span=ROW_GROUP_BYTES * 5 // (12 * 9)) if r["kind"] == "llm"]
    for r in rows:
        r["parent_id"] = None
    writer.write(pa.RecordBatch.from_pylist(rows, schema=SPAN_SCHEMA))
    writer.close()
    sealed = seal(writer.path).sealed
    assert sealed is not None and pq.ParquetFile(sealed).num_row_groups == 3
    return sealed


def test_recover_salvages_the_row_groups_that_match_and_sets_the_shard_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    shard = _row_groups_run(run_dir)
    rel = shard.relative_to(run_dir).as_posix()
    before = Run(run_dir).spans()
    pf = pq.ParquetFile(shard)
    damaged_ids = set(pf.read_row_group(1, columns=["trajectory_id"])["trajectory_id"].to_pylist())
    column = pf.metadata.row_group(1).column(SPAN_SCHEMA.get_field_index("token_ids"))
    original = shard.read_bytes()
    _flipped(shard, original, column.data_page_offset + column.total_compressed_size // 2, 0x10)

    # every reading command says the run cannot be read in full, naming the file
    capsys.readouterr()
    assert main(["sql", str(run_dir), "SELECT count(*) AS n FROM spans", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["n"] == 0 and rel in err and "could not be read in full" in err

    assert main(["recover", str(run_dir)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert rel in out and "row group 1 of 3 did not match their checksums" in out
    assert "kept 6 spans" in out
    sealed, live = list_files(run_dir)
    assert live == [] and len(sealed) == 1 and sealed[0] != shard and not shard.exists()
    aside = run_dir / "_quarantine" / rel
    assert aside.read_bytes()[: len(original)] != original and len(aside.read_bytes()) == len(original)
    assert (run_dir / "_quarantine" / tindex.index_path(Path(rel))).exists()
    run = Run(run_dir)
    after = run.spans()
    assert not run.warnings and not run.unverified
    keep = pa.array(sorted(set(before["trajectory_id"].to_pylist()) - damaged_ids))
    wanted = before.filter(pc.is_in(before["trajectory_id"], keep)).sort_by("span_id")
    assert after.sort_by("span_id").equals(wanted)
    assert set(Run(run_dir).trajectories()["id"].to_pylist()) == set(keep.to_pylist())
    # a second recover finds nothing to do
    assert main(["recover", str(run_dir)]) == 0
    assert "recovered 0 shards" in capsys.readouterr().out


def test_recover_sets_aside_a_shard_whose_footer_does_not_match(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    shard = _sealed_run(run_dir)
    data = bytearray(shard.read_bytes())
    footer_length = int.from_bytes(data[-8:-4], "little")
    data[len(data) - 8 - footer_length + 40] ^= 0x01  # in its schema
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["recover", str(run_dir)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "footer does not match its checksum" in out and "set aside 2 files" in out
    assert list_files(run_dir) == ([], [])
    assert (run_dir / "_quarantine" / shard.relative_to(run_dir)).read_bytes() == bytes(data)


def test_a_live_file_that_does_not_match_is_never_sealed_and_recover_keeps_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlreplay.errors import DamagedFileError

    run_dir = tmp_path / "run"
    live = _live_file(run_dir, batches=4)
    expected = Run(run_dir).spans()
    data = bytearray(live.read_bytes())
    data[len(data) // 2] ^= 0x20
    live.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match=live.name):
        seal(live)
    assert live.exists() and list_files(run_dir)[0] == []  # left for recover, nothing lost
    capsys.readouterr()
    assert main(["recover", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "kept 12 spans" in out and "set aside 1 file (" in out
    assert len(list_files(run_dir)[0]) == 1
    kept = Run(run_dir).spans().sort_by("span_id")
    ids = pa.array(sorted(set(kept["span_id"].to_pylist())))
    assert kept.equals(expected.filter(pc.is_in(expected["span_id"], ids)).sort_by("span_id"))


def _command(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _identical_or_refused(answer: tuple[int, str, str], expected: tuple[int, str, str], rel: str) -> str:
    """The command's answer is the undamaged run's, or it names the file and gives none of its rows:
    exit 0 with the count line (what it could read: nothing), or one line and exit 2."""
    rc, out, err = answer
    if answer == expected:
        return "identical"
    unverified = '"unverified_files": 1,', '"unverified_files": 0,'
    if (rc, out.replace(*unverified), err) == expected and not err:
        return "identical"  # the checksums' key changed: read as written before checksums, and said
    assert "Traceback" not in err and rel in err, answer
    if rc == 2:
        assert err.startswith("rlreplay: error:") and err.count("\n") == 1, err
    else:
        assert rc == 0 and "could not be read in full" in err, answer
    return "refused"


def test_every_byte_of_a_sealed_shard_reads_identical_or_refused_in_sql_info_and_ls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands the issue names, each on its own read path (``sql`` reads through a pyarrow
    dataset, ``info`` counts the files, ``ls`` lists from the index). ``sql``'s read on every byte
    of the column chunks (where values are) and every 16th of the footer (its checksum refuses it
    whole: byte by byte in the tests above); the three commands on every 16th byte."""
    from rlreplay.errors import QueryError
    from rlreplay.read.query import sql

    run_dir = tmp_path / "run"
    shard = _sealed_run(run_dir, batches=2, per_batch=1, ids_per_span=4)
    rel = shard.relative_to(run_dir).as_posix()
    original = shard.read_bytes()
    meta = pq.ParquetFile(shard).metadata
    chunks = [
        meta.row_group(g).column(c) for g in range(meta.num_row_groups) for c in range(meta.num_columns)
    ]
    starts = [c.dictionary_page_offset or c.data_page_offset for c in chunks]
    values = set().union(*(range(s, s + c.total_compressed_size) for s, c in zip(starts, chunks)))
    query = "SELECT * FROM spans ORDER BY span_id"
    commands = {
        "sql": ("sql", str(run_dir), query, "--json"),
        "info": ("info", str(run_dir), "--json"),
        "ls": ("ls", str(run_dir), "--json"),
    }
    expected = {name: _command(capsys, *args) for name, args in commands.items()}
    assert all(rc == 0 and err == "" for rc, _, err in expected.values()), expected
    assert len(expected["sql"][1].splitlines()) == 4  # the shard's 4 spans
    rows = sql(Run(run_dir), query)
    outcomes = {name: {"identical": 0, "refused": 0} for name in ("read", *commands)}
    for at in range(len(original)):
        if at not in values and at % 16:
            continue
        with _flipped_while(shard, original, at, 0xFF):
            run = Run(run_dir)
            try:
                table = sql(run, query)
            except QueryError as exc:
                assert rel in str(exc), (at, exc)
                outcomes["read"]["refused"] += 1
            else:
                if run.unreadable:
                    assert table.num_rows == 0 and rel in run.unreadable and run.incomplete(), at
                    outcomes["read"]["refused"] += 1
                else:
                    assert table.equals(rows) and not run.warnings, at  # never other values
                    outcomes["read"]["identical"] += 1
            if at % 16 == 0:
                for name, args in commands.items():
                    answer = _command(capsys, *args)
                    outcomes[name][_identical_or_refused(answer, expected[name], rel)] += 1
    assert outcomes["read"]["identical"] <= 4 + len(b"rlreplay.crc32"), outcomes
    assert outcomes["read"]["refused"] >= len(values) - 4, outcomes
    assert outcomes["info"]["refused"] > 0 and outcomes["sql"]["refused"] > 0, outcomes
    shard.write_bytes(original)
    assert {name: _command(capsys, *args) for name, args in commands.items()} == expected


def test_a_damaged_shard_is_named_with_readmes_exit_codes_in_a_new_process(tmp_path: Path) -> None:
    """A few flips end to end: ``sql``, ``info`` and ``ls`` answer as for the undamaged run (a
    command that does not read the damaged part), or name the file and exit 0 with the line of
    counts (or 2 in one line), never a traceback."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    shard = _sealed_run(run_dir, batches=2, per_batch=1, ids_per_span=4)
    rel = shard.relative_to(run_dir).as_posix()
    original = shard.read_bytes()
    column = pq.ParquetFile(shard).metadata.row_group(0).column(SPAN_SCHEMA.get_field_index("span_id"))
    start = column.dictionary_page_offset or column.data_page_offset
    footer = len(original) - 8 - int.from_bytes(original[-8:-4], "little")

    def answer(*args: str) -> tuple[int, str, str]:
        proc = subprocess.run(
            [sys.executable, "-m", "rlreplay", args[0], str(run_dir), *args[1:]],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return proc.returncode, proc.stdout, proc.stderr

    commands = [("sql", "SELECT span_id FROM spans ORDER BY span_id"), ("info",), ("ls",)]
    expected = {args: answer(*args) for args in commands}
    for at in (start + column.total_compressed_size // 2, footer + 40):
        _flipped(shard, original, at, 0x01)
        outcomes = [_identical_or_refused(answer(*args), expected[args], rel) for args in commands]
        assert outcomes[0] == "refused" and (at < footer or outcomes[1] == "refused"), (at, outcomes)
