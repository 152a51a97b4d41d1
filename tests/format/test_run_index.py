"""The run index: one file of every sealed shard's merged trajectory rows, kept exact as shards are
added, sealed, recovered or removed; an unreadable one is ignored; read-only runs still list."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import rlreplay
from rlreplay.format import index as tindex
from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.read import summary
from rlreplay.read.selection import Selection
from rlreplay.shards.layout import new_uid, partition_dir
from rlreplay.shards.live import PartialWriter
from rlreplay.shards.seal import write_sealed

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"
SHARDS = tindex.RUN_INDEX_MIN_SHARDS + 4  # enough for the run index to be written
PER_SHARD = 3  # trajectories per shard


def _retag(table: pa.Table, prefix: str, step: int) -> pa.Table:
    """The spans with ids prefixed (new trajectories) and moved to ``step``."""
    for name in ("trajectory_id", "span_id", "parent_id"):
        column = pc.binary_join_element_wise(pa.scalar(prefix), table[name], "")
        table = table.set_column(table.schema.get_field_index(name), name, column)
    return table.set_column(table.schema.get_field_index("step"), "step", pa.array([step] * table.num_rows))


def _write(run: Path, table: pa.Table, step: int, worker: str = "w0") -> Path:
    folder = partition_dir(run, step, worker)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"part-{new_uid()}.parquet"
    write_sealed(table, path)
    return path


def _signals(spans: pa.Table, trajectory_id: str, reward: float, end_ns: int) -> pa.Table:
    """A ``signals`` row (as the trainer writes one) for a trajectory of ``spans``."""
    rows = spans.filter(pc.equal(spans["trajectory_id"], trajectory_id)).to_pylist()
    root = next(r for r in rows if r["parent_id"] is None)
    row = {**root, "span_id": f"sig{new_uid()}", "parent_id": root["span_id"], "kind": "signals"}
    row.update(name="signals", reward=reward, start_ns=end_ns - 1, end_ns=end_ns, worker="trainer")
    return pa.Table.from_pylist([row], schema=SPAN_SCHEMA)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pa.Table]:
    """A run of SHARDS sealed shards (one per step) of the sample run's spans, and its span rows."""
    sample = rlreplay.open_run(SAMPLE).spans()
    run = tmp_path_factory.mktemp("run-index") / "run"
    written = []
    for step in range(SHARDS):
        spans = sample.filter(pc.equal(sample["step"], step % 8))
        ids = sorted(set(spans["trajectory_id"].to_pylist()))[:PER_SHARD]
        part = _retag(spans.filter(pc.is_in(spans["trajectory_id"], pa.array(ids))), f"{step:04x}", step)
        _write(run, part, step)
        written.append(part)
    (run / "run.json").write_text('{"format_version": 2}')
    return run, pa.concat_tables([t.cast(SPAN_SCHEMA) for t in written])


@pytest.fixture
def run_dir(base_run: tuple[Path, pa.Table], tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "run"
    shutil.copytree(base_run[0], target)
    yield target


def expected(*tables: pa.Table) -> dict[str, tuple[Any, ...]]:
    """Listing columns per trajectory, by the listing's rules written out over plain rows."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in (r for t in tables for r in t.to_pylist()):
        by_id.setdefault(row["trajectory_id"], []).append(row)
    out = {}
    for tid, rows in by_id.items():
        roots = [r for r in rows if r["parent_id"] is None and r["kind"] != "signals"]
        status = "incomplete" if not roots else ("error" if roots[0]["status"] == "error" else "ok")
        rewarded = [r for r in rows if r["kind"] == "signals" and r["reward"] is not None] or [
            r for r in rows if r["kind"] in ("agent", "trajectory") and r["reward"] is not None
        ]
        reward = max(rewarded, key=lambda r: r["end_ns"])["reward"] if rewarded else None
        tools = [r for r in rows if r["kind"] == "tool"]
        out[tid] = (
            rows[0]["step"],
            len(rows),
            sum(r["kind"] == "llm" for r in rows),
            len(tools),
            sum(r["status"] == "error" for r in tools),
            status,
            reward,
        )
    return out


def listed(table: pa.Table) -> dict[str, tuple[Any, ...]]:
    cols = ["id", "step", "num_spans", "model_calls", "tool_calls", "tool_errors", "status", "reward"]
    return {r[0]: tuple(r[1:]) for r in zip(*(table[c].to_pylist() for c in cols))}


def covered(run: Path) -> set[str]:
    found = tindex.read_run_index(run / tindex.RUN_INDEX)
    assert found is not None
    return set(found[1])


def sealed_names(run: Path) -> set[str]:
    return {p.relative_to(run).as_posix() for p in run.glob("spans/*/*/*.parquet")}


def test_the_run_index_is_written_once_and_lists_exactly(
    run_dir: Path, base_run: tuple[Path, pa.Table]
) -> None:
    want = expected(base_run[1])
    assert len(want) == SHARDS * PER_SHARD
    first = rlreplay.open_run(run_dir)
    assert listed(first.trajectories()) == want
    assert covered(run_dir) == sealed_names(run_dir)

    again = rlreplay.open_run(run_dir)
    table = again.trajectories()
    assert listed(table) == want
    assert again._indexes == {}  # no shard's own index file was read
    assert not again.warnings
    # every reader of the listing sees the same rows
    assert listed(Selection().trajectories(again)) == want
    assert listed(Selection(step="3..5,30").trajectories(again)) == {
        k: v for k, v in want.items() if v[0] in (3, 4, 5, 30)
    }
    assert again._indexes == {}  # a step range reads the run index's row groups of these steps
    some = table["id"][5].as_py()
    assert again.resolve(some[:12]) == (some, want[some][0])


def test_shards_sealed_after_the_run_index_are_listed_and_added(
    run_dir: Path, base_run: tuple[Path, pa.Table]
) -> None:
    spans = base_run[1]
    rlreplay.open_run(run_dir).trajectories()  # writes the run index
    sample = rlreplay.open_run(SAMPLE).spans(step=2)
    new = _retag(
        sample.filter(pc.is_in(sample["trajectory_id"], pc.unique(sample["trajectory_id"])[:2])), "n", 99
    )
    _write(run_dir, new, 99)
    target = sorted(set(spans.filter(pc.equal(spans["step"], 3))["trajectory_id"].to_pylist()))[0]
    late = _signals(spans, target, reward=-7.5, end_ns=2**62)
    _write(run_dir, late, 3, worker="trainer")  # the same trajectory in a second shard

    want = expected(spans, new, late)
    assert want[target][-1] == -7.5
    in_steps = {k: v for k, v in want.items() if v[0] in (2, 3, 99)}
    assert listed(Selection(step="2..3,99").trajectories(rlreplay.open_run(run_dir))) == in_steps
    assert listed(rlreplay.open_run(run_dir).trajectories()) == want
    assert covered(run_dir) == sealed_names(run_dir)
    again = rlreplay.open_run(run_dir)
    assert listed(again.trajectories()) == want
    assert again._indexes == {}


def test_live_shards_are_listed_then_sealed_by_recover(
    run_dir: Path, base_run: tuple[Path, pa.Table]
) -> None:
    spans = base_run[1]
    rlreplay.open_run(run_dir).trajectories()
    before = covered(run_dir)
    target = sorted(set(spans.filter(pc.equal(spans["step"], 4))["trajectory_id"].to_pylist()))[1]
    late = _signals(spans, target, reward=3.25, end_ns=2**62)
    sample = rlreplay.open_run(SAMPLE).spans(step=6)
    fresh = _retag(sample.filter(pc.equal(sample["trajectory_id"], sample["trajectory_id"][0])), "live", 4)
    writer = PartialWriter(partition_dir(run_dir, 4, "w1"))
    writer.write(late.to_batches()[0])
    for batch in fresh.cast(SPAN_SCHEMA).to_batches():
        writer.write(batch)
    want = expected(spans, late, fresh)
    try:
        run = rlreplay.open_run(run_dir)
        assert listed(run.trajectories()) == want  # the live file, read as it is
        assert covered(run_dir) == before  # and never in the run index
        assert listed(Selection(step="4").trajectories(run)) == {k: v for k, v in want.items() if v[0] == 4}
    finally:
        writer.close()
    totals = summary.recover(run_dir)
    assert totals["recovered_shards"] == 1
    assert covered(run_dir) == sealed_names(run_dir) and len(covered(run_dir)) == len(before) + 1
    assert listed(rlreplay.open_run(run_dir).trajectories()) == want


def test_a_shard_gone_from_the_run_index_rebuilds_it(run_dir: Path, base_run: tuple[Path, pa.Table]) -> None:
    spans = base_run[1]
    rlreplay.open_run(run_dir).trajectories()
    for path in (run_dir / "spans" / "step=7").glob("*/*"):
        path.unlink()  # its folders stay: step 7 is still a partition, with no shard
    want = expected(spans.filter(pc.not_equal(spans["step"], 7)))
    in_steps = {k: v for k, v in want.items() if v[0] in (6, 7, 8)}
    assert listed(Selection(step="6..8").trajectories(rlreplay.open_run(run_dir))) == in_steps
    run = rlreplay.open_run(run_dir)
    assert listed(run.trajectories()) == want
    assert not run.warnings
    assert covered(run_dir) == sealed_names(run_dir)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign"])
def test_an_unreadable_run_index_is_ignored_with_one_warning(
    run_dir: Path, base_run: tuple[Path, pa.Table], damage: str
) -> None:
    want = expected(base_run[1])
    rlreplay.open_run(run_dir).trajectories()
    path = run_dir / tindex.RUN_INDEX
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not a parquet file" * 100)
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # a Parquet file, but not a run index
        import pyarrow.parquet as pq

        versions = {tindex.RUN_INDEX_KEY: tindex.RUN_INDEX_VERSION, tindex.INDEX_KEY: tindex.INDEX_VERSION}
        pq.write_table(pa.table({"x": [1]}).replace_schema_metadata(versions), path)
    run = rlreplay.open_run(run_dir)
    assert listed(run.trajectories()) == want
    assert listed(run.trajectories()) == want
    assert [w for w in run.warnings if "run index" in w] == run.warnings and len(run.warnings) == 1
    assert tindex.read_run_index(path) is not None  # replaced by a good one
    again = rlreplay.open_run(run_dir)
    assert listed(again.trajectories()) == want and not again.warnings


def _list_as(uid: int | None, run: str, cache: str, conn: Any) -> None:
    """In a forked child: drop to ``uid`` (when root), list the run, send what was listed."""
    try:
        if uid is not None:
            os.setgid(uid)
            os.setuid(uid)
        os.environ["XDG_CACHE_HOME"] = cache
        opened = rlreplay.open_run(run)
        conn.send((listed(opened.trajectories()), opened.warnings, None))
    except BaseException as exc:  # reported to the test
        conn.send((None, None, repr(exc)))


@pytest.mark.parametrize(
    "shipped", [False, True], ids=["no-run-index", "shipped-run-index-and-a-newer-shard"]
)
def test_a_read_only_run_is_listed_and_indexed_in_the_user_cache(
    base_run: tuple[Path, pa.Table], shipped: bool
) -> None:
    tables = [base_run[1]]
    rlreplay.open_run(SAMPLE).trajectories()  # the child imports nothing more (root's home is private)
    top = Path(tempfile.mkdtemp(prefix="rlreplay-ro-"))
    try:
        top.chmod(0o755)
        run = top / "run"
        shutil.copytree(base_run[0], run)
        if shipped:  # its run index was written while it could be; a shard came after
            rlreplay.open_run(run).trajectories()
            shipped_index = (run / tindex.RUN_INDEX).read_bytes()
            sample = rlreplay.open_run(SAMPLE).spans(step=1)
            tables.append(
                _retag(sample.filter(pc.equal(sample["trajectory_id"], sample["trajectory_id"][0])), "ro", 77)
            )
            _write(run, tables[-1], 77)
        want = expected(*tables)
        cache = top / "cache"
        cache.mkdir(mode=0o777)
        cache.chmod(0o777)
        for path in [run, *run.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        uid = 65534 if os.geteuid() == 0 else None  # root writes anywhere: list as nobody
        ctx = multiprocessing.get_context("fork")
        writes = []
        for attempt in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_list_as, args=(uid, str(run), str(cache), child))
            proc.start()
            rows, warnings, error = parent.recv()
            proc.join(30)
            assert error is None
            assert rows == want, attempt
            assert warnings == []
            if shipped:
                assert (run / tindex.RUN_INDEX).read_bytes() == shipped_index
            else:
                assert not (run / tindex.RUN_INDEX).exists()
            found = list(cache.rglob(f"*{tindex.INDEX_SUFFIX}"))
            assert len(found) == 1
            index = tindex.read_run_index(found[0])
            assert index is not None and set(index[1]) == sealed_names(run)
            writes.append((found[0].stat().st_ino, found[0].stat().st_mtime_ns))
        assert writes[1] == writes[0]  # the second listing read the fuller one and wrote nothing
    finally:
        for path in [top, *top.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(top)


def test_a_run_index_damaged_where_it_still_parses_is_ignored_and_rebuilt(
    run_dir: Path, base_run: tuple[Path, pa.Table]
) -> None:
    import pyarrow.parquet as pq

    # 128 trajectories: every 7-bit dictionary index names one of them, so damaged indices decode
    sample = rlreplay.open_run(SAMPLE).spans(step=0)
    more_ids = sorted(set(sample["trajectory_id"].to_pylist()))[: 128 - SHARDS * PER_SHARD]
    more = _retag(sample.filter(pc.is_in(sample["trajectory_id"], pa.array(more_ids))), "more", SHARDS)
    _write(run_dir, more, SHARDS)
    want = expected(base_run[1], more.cast(SPAN_SCHEMA))
    assert len(want) == 128
    assert listed(rlreplay.open_run(run_dir).trajectories()) == want
    path = run_dir / tindex.RUN_INDEX
    meta = pq.ParquetFile(path).metadata
    assert meta.num_row_groups == 1
    chunk = meta.row_group(0).column(tindex.INDEX_SCHEMA.get_field_index("id"))
    end = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size
    data = bytearray(path.read_bytes())
    data[end - 30 : end - 10] = bytes(b ^ 0xFF for b in data[end - 30 : end - 10])  # the ids' indices
    path.write_bytes(bytes(data))
    damaged = pq.read_table(path)["id"].to_pylist()  # it still parses, to ids repeated and lost
    assert len(damaged) == 128 and len(set(damaged)) < 128

    run = rlreplay.open_run(run_dir)
    ids = run.trajectories()["id"].to_pylist()
    assert sorted(ids) == sorted(want)
    assert listed(run.trajectories()) == want
    assert [w for w in run.warnings if "run index" in w] == run.warnings and len(run.warnings) == 1
    assert len(set(pq.read_table(path)["id"].to_pylist())) == 128  # replaced by a good one
    again = rlreplay.open_run(run_dir)
    assert listed(again.trajectories()) == want and not again.warnings


def test_a_shard_index_damaged_where_it_still_parses_is_ignored(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    spans = rlreplay.open_run(SAMPLE).spans(step=0).cast(SPAN_SCHEMA)
    run = tmp_path / "run"
    shard = _write(run, spans, 0)
    (run / "run.json").write_text('{"format_version": 2}')
    want = expected(spans)
    path = tindex.index_path(shard)
    good = path.read_bytes()
    good_ids = pq.read_table(path)["id"].to_pylist()
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(tindex.INDEX_SCHEMA.get_field_index("id"))
    for at in range(chunk.data_page_offset + 8, chunk.data_page_offset + chunk.total_compressed_size - 8):
        data = bytearray(good)
        data[at : at + 4] = bytes(b ^ 0x5A for b in data[at : at + 4])
        path.write_bytes(bytes(data))
        try:
            if pq.read_table(path)["id"].to_pylist() != good_ids:
                break  # damaged, yet it decodes: to other ids
        except (OSError, pa.ArrowException):
            continue
    else:
        pytest.fail("no damage to the ids' page that still decodes")
    run_ = rlreplay.open_run(run)
    assert listed(run_.trajectories()) == want
    assert listed(run_.trajectories(step=0)) == want
