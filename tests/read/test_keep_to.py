"""A read kept to a part of a step (``Run.keep_to``, what an ``--engine ray`` task does with a
piece of a step): the rows of its trajectories as a read of the whole step holds them, and a
span file damaged anywhere skipped and warned about as a read of the whole step skips it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlreplay.format import index as tindex
from rlreplay.read.open import open_run
from rlreplay.read.scan import step_rows, step_spans
from rlreplay.shards.seal import write_sealed

SHOWCASE = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-arith-smollm2"
STEP = 3  # two span files


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """The showcase run, step 3's rows written again as two files, each holding the whole of
    half its trajectories, a row group a trajectory."""
    import pyarrow as pa
    import pyarrow.compute as pc

    run_dir = shutil.copytree(SHOWCASE, tmp_path / "run")
    paths = sorted(run_dir.glob(f"spans/step={STEP}/*/*.parquet"))
    run = open_run(run_dir)
    rows = pa.concat_tables([run.file_rows(p) for p in paths])
    for path in paths:
        path.unlink()
        tindex.index_path(path).unlink()
    ids = sorted(set(rows["trajectory_id"].to_pylist()))
    first = pc.is_in(rows["trajectory_id"], pa.array(ids[: len(ids) // 2]))
    write_sealed(rows.filter(first), paths[0], row_group_bytes=1)
    write_sealed(rows.filter(pc.invert(first)), paths[1], row_group_bytes=1)
    return run_dir


def _files(run_dir: Path) -> list[tuple[Path, list[str]]]:
    """The step's span files and the trajectories each holds (by its index file)."""
    out = []
    for path in sorted(run_dir.glob(f"spans/step={STEP}/*/*.parquet")):
        index = tindex.read(tindex.index_path(path), path.stat().st_size)
        out.append((path, index["id"].to_pylist()))
    return out


def _step_ids(run_dir: Path) -> list[str]:
    listing = open_run(run_dir).trajectories()
    rows = dict(step_rows(listing))[STEP]
    return [listing["id"][int(r)].as_py() for r in rows]


def test_a_part_reads_its_trajectories_as_the_whole_step_holds_them(run_dir: Path) -> None:
    (first, in_first), _ = _files(run_dir)
    assert pq.ParquetFile(first).num_row_groups == len(in_first) > 4
    ids = _step_ids(run_dir)
    for piece in (ids[:5], ids[5:13], ids[13:]):
        whole = step_spans(open_run(run_dir), STEP, piece)
        kept = open_run(run_dir)
        kept.keep_to(piece, owner=False)
        part = step_spans(kept, STEP, piece)
        assert part.table.num_rows == whole.table.num_rows > 0
        assert part.table.equals(whole.table) and list(part.starts) == list(whole.starts)
        assert kept.notes() == [] and kept.unverified == set()


def _groups(path: Path) -> dict[str, list[int]]:
    """Each trajectory's row groups in a span file (by its index file)."""
    index = tindex.read(tindex.index_path(path), path.stat().st_size)
    return dict(zip(index["id"].to_pylist(), index["row_groups"].to_pylist()))


def _damage(path: Path, row_group: int) -> None:
    """One byte changed in the middle of a column chunk of ``row_group`` (its ``output``)."""
    metadata = pq.ParquetFile(path).metadata
    group = metadata.row_group(row_group)
    column = next(
        group.column(j) for j in range(group.num_columns) if group.column(j).path_in_schema == "output"
    )
    at = column.data_page_offset + column.total_compressed_size // 2
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _read(run_dir: Path, piece: list[str], owner: bool | None):
    run = open_run(run_dir)
    if owner is not None:
        run.keep_to(piece, owner)
    return run, step_spans(run, STEP, piece)


def test_a_file_damaged_where_a_part_does_not_read_is_skipped_as_a_whole_read(run_dir: Path) -> None:
    (first, _), (_, in_second) = _files(run_dir)
    groups = _groups(first)
    ids = _step_ids(run_dir)
    mine = [i for i in ids if i in groups][:2]  # a part with rows in the first file
    others = [i for i in ids if i in in_second and i not in groups]  # rows in the second file only
    assert mine and others
    held = {g for i in mine for g in groups[i]}
    _damage(first, next(g for g in range(len(groups)) if g not in held))
    rel = str(first.relative_to(run_dir))

    whole, expected = _read(run_dir, mine, None)
    assert any(rel in w and "do not match their checksum" in w for w in whole.warnings)
    assert expected.table.num_rows == 0  # every row of ``mine`` is in the damaged file
    for owner in (False, True):
        kept, part = _read(run_dir, mine, owner)
        assert kept.warnings == whole.warnings and kept.unreadable == whole.unreadable
        assert part.table.equals(expected.table)
        if owner:  # it read every file of the step: the "not in full" line's counts too
            assert kept.notes() == whole.notes()

    whole, expected = _read(run_dir, others, None)
    owner, part = _read(run_dir, others, True)  # the step's first piece: it verifies every file
    assert owner.notes() == whole.notes() and part.table.equals(expected.table)
    assert expected.table.num_rows > 0 and rel in whole.unreadable
    rest, part = _read(run_dir, others, False)  # another piece: the damaged file is not its
    assert rest.notes() == [] and rel not in rest.files_read and part.table.equals(expected.table)
