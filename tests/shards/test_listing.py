"""Listing a run's span files: every sealed shard and live file, in the order of sorted paths."""

from __future__ import annotations

from pathlib import Path

from rlreplay.shards.layout import list_files, list_names, partition_dir


def test_the_listing_finds_every_span_file_in_path_order(tmp_path: Path) -> None:
    run = tmp_path / "run"
    made_sealed: list[Path] = []
    made_live: list[Path] = []
    # names whose string order differs from their path order ("w-1" < "w/" < "w.2" as strings)
    for step in (1, 10, 2, None):
        for worker in ("w", "w-1", "w.2", "w_3"):
            folder = partition_dir(run, step, worker)
            folder.mkdir(parents=True)
            for name in ("part-a.parquet", "part-b-c.parquet"):
                (folder / name).write_bytes(b"x")
                made_sealed.append(folder / name)
            (folder / "_part-live.partial").write_bytes(b"x")
            made_live.append(folder / "_part-live.partial")
            (folder / "_part-a.partial").write_bytes(b"x")  # sealed already: not live any more
            (folder / ".part-tmp.parquet").write_bytes(b"x")
            (folder / "_part-x.parquet").write_bytes(b"x")
            (folder / "part-a.parquet.index").write_bytes(b"x")
    (partition_dir(run, 1, "w").parent / "stray-file").write_bytes(b"x")

    sealed, live = list_files(run)
    assert sealed == sorted(made_sealed)
    assert live == sorted(made_live)
    assert list_names(run) == ([str(p) for p in sealed], [str(p) for p in live])
    one = list_files(run, step=10)
    assert one == (
        sorted(p for p in made_sealed if p.parts[-3] == "step=10"),
        sorted(p for p in made_live if p.parts[-3] == "step=10"),
    )
    assert list_files(run, step=7) == ([], [])
