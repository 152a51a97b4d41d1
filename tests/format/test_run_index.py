"""The run index: segment files of sealed shards' merged trajectory rows, kept exact as shards are
added, sealed, recovered or removed; an unreadable segment is ignored and only its shards read again;
read-only runs still list."""

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
from rlreplay.format import run_index
from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.read import summary
from rlreplay.read.selection import Selection
from rlreplay.shards.layout import new_uid, partition_dir
from rlreplay.shards.live import PartialWriter
from rlreplay.shards.seal import write_sealed

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "gsm8k-grpo-qwen3"
SHARDS = run_index.RUN_INDEX_MIN_SHARDS + 4  # enough for the run index to be written
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


def segment_files(run: Path) -> list[Path]:
    return sorted((run / run_index.RUN_INDEX_DIR).glob(f"*{tindex.INDEX_SUFFIX}"))


def covered(run: Path) -> set[str]:
    """The shards the run's segments cover, each shard by one segment only."""
    names = [rel for path in segment_files(run) for rel in run_index.read_covered(path) or {}]
    assert len(names) == len(set(names))
    return set(names)


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


def _listings_of(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The steps the run's file listings ask for from now on (None: every step)."""
    import rlreplay.read.store as store_module

    asked: list[int | None] = []
    real = store_module.list_names

    def listing(run: Path, step: int | None = None) -> tuple[list[str], list[str]]:
        asked.append(step)
        return real(run, step)

    monkeypatch.setattr(store_module, "list_names", listing)
    return asked


def test_a_whole_id_is_found_from_its_step_alone(
    run_dir: Path, base_run: tuple[Path, pa.Table], monkeypatch: pytest.MonkeyPatch
) -> None:
    spans = base_run[1]
    rlreplay.open_run(run_dir).trajectories()  # writes the run index
    target = sorted(set(spans.filter(pc.equal(spans["step"], 5))["trajectory_id"].to_pylist()))[1]
    asked = _listings_of(monkeypatch)
    run = rlreplay.open_run(run_dir)
    assert run.resolve(target) == (target, 5)
    traj = run.trajectory(target)
    assert traj.id == target
    assert len(traj.spans) == pc.sum(pc.equal(spans["trajectory_id"], target)).as_py()
    assert asked and set(asked) == {5}  # no listing of the whole run


def test_a_whole_id_the_run_index_does_not_hold_or_holds_wrongly_is_found_by_the_listing(
    run_dir: Path, base_run: tuple[Path, pa.Table]
) -> None:
    spans = base_run[1]
    rlreplay.open_run(run_dir).trajectories()
    sample = rlreplay.open_run(SAMPLE).spans(step=1)
    new = _retag(sample.filter(pc.equal(sample["trajectory_id"], sample["trajectory_id"][0])), "1a7e", 40)
    _write(run_dir, new, 40)  # sealed after the run index was written
    late = new["trajectory_id"][0].as_py()
    assert rlreplay.open_run(run_dir).resolve(late) == (late, 40)
    gone = sorted(set(spans.filter(pc.equal(spans["step"], 9))["trajectory_id"].to_pylist()))[0]
    for path in (run_dir / "spans" / "step=9").glob("*/*"):
        path.unlink()  # the run index still names its step
    with pytest.raises(rlreplay.RunError, match="no trajectory"):
        rlreplay.open_run(run_dir).resolve(gone)


def test_a_whole_id_that_begins_another_is_itself(run_dir: Path, base_run: tuple[Path, pa.Table]) -> None:
    spans = base_run[1]
    target = sorted(set(spans.filter(pc.equal(spans["step"], 2))["trajectory_id"].to_pylist()))[0]
    longer = spans.filter(pc.equal(spans["trajectory_id"], target))
    for name in ("trajectory_id", "span_id", "parent_id"):
        column = pc.binary_join_element_wise(longer[name], pa.scalar("0"), "")
        longer = longer.set_column(longer.schema.get_field_index(name), name, column)
    longer = longer.set_column(longer.schema.get_field_index("step"), "step", pa.array([3] * longer.num_rows))
    _write(run_dir, longer, 3, worker="w1")
    for listed_first in (False, True):
        run = rlreplay.open_run(run_dir)
        if listed_first:
            run.trajectories()
        assert run.resolve(target) == (target, 2)
        assert run.resolve(target + "0") == (target + "0", 3)
        with pytest.raises(rlreplay.RunError, match="ambiguous"):
            run.resolve(target[:-1])


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign"])
def test_an_unreadable_run_index_is_ignored_with_one_warning(
    run_dir: Path, base_run: tuple[Path, pa.Table], damage: str
) -> None:
    want = expected(base_run[1])
    rlreplay.open_run(run_dir).trajectories()
    [path] = segment_files(run_dir)
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not a parquet file" * 100)
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # a Parquet file, but not a run index
        import pyarrow.parquet as pq

        versions = {
            run_index.RUN_INDEX_KEY: run_index.RUN_INDEX_VERSION,
            tindex.INDEX_KEY: tindex.INDEX_VERSION,
        }
        pq.write_table(pa.table({"x": [1]}).replace_schema_metadata(versions), path)
    run = rlreplay.open_run(run_dir)
    assert listed(run.trajectories()) == want
    assert listed(run.trajectories()) == want
    assert [w for w in run.warnings if "run index" in w] == run.warnings and len(run.warnings) == 1
    assert not path.exists() and covered(run_dir) == sealed_names(run_dir)  # replaced by a good one
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
            shipped_index = {p.name: p.read_bytes() for p in segment_files(run)}
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
                assert {p.name: p.read_bytes() for p in segment_files(run)} == shipped_index
            else:
                assert not (run / run_index.RUN_INDEX_DIR).exists()
            found = list(cache.rglob(f"*{tindex.INDEX_SUFFIX}"))
            assert len(found) == 1
            in_cache = run_index.read_covered(found[0])
            assert in_cache is not None
            assert set(in_cache) == sealed_names(run) - (covered(run) if shipped else set())
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
    [path] = segment_files(run_dir)
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
    assert not path.exists()  # replaced by a good one
    assert sorted(i for p in segment_files(run_dir) for i in pq.read_table(p)["id"].to_pylist()) == sorted(
        want
    )
    again = rlreplay.open_run(run_dir)
    assert listed(again.trajectories()) == want and not again.warnings


#: A run index written from this many shards on (in the tests that lower the threshold)
FEW_SHARDS = 4


def test_any_byte_of_a_run_index_segment_lists_identical_or_is_rebuilt(
    base_run: tuple[Path, pa.Table], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed byte anywhere in a segment (every 53rd byte of its ~16 KB, each page and the
    footer): the listing is the undamaged one, read from the shards' own index files when the
    segment's checksums refuse it, and only the segment is named. The segment of a run of a few
    shards (the threshold lowered from 32): a damaged one is rebuilt from each of its shards."""
    monkeypatch.setattr(run_index, "RUN_INDEX_MIN_SHARDS", FEW_SHARDS)
    shards = FEW_SHARDS
    run_dir = tmp_path / "run"
    for step in range(shards):  # the first steps of the module's run, one shard each
        folder = partition_dir(run_dir, step, "w0").relative_to(run_dir)
        shutil.copytree(base_run[0] / folder, run_dir / folder)
    shutil.copyfile(base_run[0] / "run.json", run_dir / "run.json")
    spans = base_run[1].filter(pc.less(base_run[1]["step"], shards))
    want = rlreplay.open_run(run_dir).trajectories().sort_by("id")
    assert listed(want) == expected(spans) and len(sealed_names(run_dir)) == shards
    [path] = segment_files(run_dir)
    assert covered(run_dir) == sealed_names(run_dir)
    original = path.read_bytes()
    refused = 0
    for at in range(0, len(original), 53):
        for stale in segment_files(run_dir):  # the one rebuilt after the last damaged one
            stale.unlink()
        data = bytearray(original)
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))
        run = rlreplay.open_run(run_dir)
        assert run.trajectories().sort_by("id").equals(want), at
        assert all("run index" in w and path.name in w for w in run.warnings), (at, run.warnings)
        refused += bool(run.warnings)
    assert refused >= len(range(0, len(original), 53)) - 2  # only the magic number goes unread


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


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments of at most 8 shards, three of a size merging: a 36-shard run writes several."""
    monkeypatch.setattr(run_index, "SEGMENT_MAX_SHARDS", 8)
    monkeypatch.setattr(run_index, "FANOUT", 3)


def segment_bytes(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in segment_files(run)}


@pytest.mark.usefixtures("small_segments")
def test_a_cold_listing_writes_segments_of_at_most_the_cap(
    run_dir: Path, base_run: tuple[Path, pa.Table]
) -> None:
    want = expected(base_run[1])
    run = rlreplay.open_run(run_dir)
    assert listed(run.trajectories()) == want
    sizes = sorted(len(run_index.read_covered(p) or {}) for p in segment_files(run_dir))
    assert sizes == sorted([8] * (SHARDS // 8) + [SHARDS % 8])
    assert covered(run_dir) == sealed_names(run_dir)
    assert run._indexes == {}  # the shards' own index rows are let go once a segment holds them
    again = rlreplay.open_run(run_dir)
    assert listed(again.trajectories()) == want and again._indexes == {} and not again.warnings


@pytest.mark.usefixtures("small_segments")
@pytest.mark.parametrize("change", ["damaged", "shard gone"])
def test_a_damaged_or_stale_segment_costs_only_its_own_shards(
    run_dir: Path, base_run: tuple[Path, pa.Table], change: str
) -> None:
    spans = base_run[1]
    rlreplay.open_run(run_dir).trajectories()
    before = segment_bytes(run_dir)
    victim = next(p for p in segment_files(run_dir) if len(run_index.read_covered(p) or {}) == 8)
    its_shards = set(run_index.read_covered(victim) or {})
    if change == "damaged":
        victim.write_bytes(victim.read_bytes()[:100])
        want = expected(spans)
    else:
        gone = sorted(its_shards)[0]
        (run_dir / gone).unlink()
        tindex.index_path(run_dir / gone).unlink()
        gone_step = int(gone.split("/")[1].removeprefix("step="))
        want = expected(spans.filter(pc.not_equal(spans["step"], gone_step)))
        its_shards.discard(gone)
    run = rlreplay.open_run(run_dir)
    assert listed(run.trajectories()) == want
    assert len(run.warnings) == (1 if change == "damaged" else 0)
    after = segment_bytes(run_dir)
    kept = {name: data for name, data in after.items() if name in before}
    assert kept == {name: data for name, data in before.items() if name != victim.name}
    [new] = [p for p in segment_files(run_dir) if p.name not in before]
    assert set(run_index.read_covered(new) or {}) == its_shards  # read again: its shards, no other
    assert covered(run_dir) == sealed_names(run_dir)
    assert listed(rlreplay.open_run(run_dir).trajectories()) == want


@pytest.mark.usefixtures("small_segments")
def test_a_growing_run_merges_small_segments_and_lists_exactly(
    run_dir: Path, base_run: tuple[Path, pa.Table]
) -> None:
    tables = [base_run[1]]
    rlreplay.open_run(run_dir).trajectories()
    sample = rlreplay.open_run(SAMPLE).spans(step=5)
    ids = sorted(set(sample["trajectory_id"].to_pylist()))
    counts = []
    for n in range(12):  # a live run: a shard sealed, a listing, ...
        tables.append(_retag(sample.filter(pc.equal(sample["trajectory_id"], ids[n])), f"g{n:02d}", 200 + n))
        _write(run_dir, tables[-1], 200 + n)
        assert listed(rlreplay.open_run(run_dir).trajectories()) == expected(*tables), n
        assert covered(run_dir) == sealed_names(run_dir), n
        counts.append(len(segment_files(run_dir)))
    # 5 segments from the first listing, one more a listing, small ones merged: never FANOUT more
    assert max(counts) <= 5 + 3 and counts[-1] < 5 + 12
    sizes = [len(run_index.read_covered(p) or {}) for p in segment_files(run_dir)]
    assert max(sizes) <= 8 and sum(sizes) == SHARDS + 12


@pytest.mark.usefixtures("small_segments")
def test_two_segments_covering_the_same_shards_are_counted_once(
    run_dir: Path, base_run: tuple[Path, pa.Table]
) -> None:
    want = expected(base_run[1])
    rlreplay.open_run(run_dir).trajectories()
    first = segment_files(run_dir)[0]
    twin = first.with_name("0" + first.name)  # as two readers listing at once would both write it
    shutil.copy2(first, twin)
    run = rlreplay.open_run(run_dir)
    assert listed(run.trajectories()) == want
    assert not run.warnings
    assert first.exists() != twin.exists()  # the one not used is removed
    assert covered(run_dir) == sealed_names(run_dir)


def _list_repeatedly(run: str, times: int, conn: Any) -> None:
    try:
        seen = [listed(rlreplay.open_run(run).trajectories()) for _ in range(times)]
        conn.send((seen, None))
    except BaseException as exc:  # reported to the test
        conn.send((None, repr(exc)))


@pytest.mark.usefixtures("small_segments")
def test_readers_listing_at_once_while_shards_are_sealed_stay_exact(
    run_dir: Path, base_run: tuple[Path, pa.Table]
) -> None:
    """Three processes list the run over and over (each writing, merging and removing segments)
    while shards are sealed; every listing holds each trajectory sealed before it began, counted
    once, and afterwards each shard is in exactly one segment."""
    tables = [base_run[1]]
    sample = rlreplay.open_run(SAMPLE).spans(step=6)
    ids = sorted(set(sample["trajectory_id"].to_pylist()))
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for _ in range(3):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=_list_repeatedly, args=(str(run_dir), 12, child)))
        pipes.append(parent)
    for proc in procs:
        proc.start()
    for n in range(10):
        tables.append(_retag(sample.filter(pc.equal(sample["trajectory_id"], ids[n])), f"c{n:02d}", 300 + n))
        _write(run_dir, tables[-1], 300 + n)
    results = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join(60)
    final = expected(*tables)
    for seen, error in results:
        assert error is None
        for listing in seen:
            assert set(listing) <= set(final)
            assert {k: final[k] for k in listing} == listing  # no trajectory counted twice or changed
            assert set(expected(base_run[1])) <= set(listing)
    assert listed(rlreplay.open_run(run_dir).trajectories()) == final
    assert covered(run_dir) == sealed_names(run_dir)
