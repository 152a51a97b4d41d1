"""Whole-run listing of a run of many shards: cold (no run index), warm (run index current), and with
one run index segment damaged (only its shards are read again)."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from rlreplay.format import run_index
from rlreplay.read.run import Run


def listing_seconds(run_dir: Path) -> tuple[float, int]:
    """Seconds for one fresh ``Run(...).trajectories()`` (what ``ls`` lists), and its row count."""
    start = time.perf_counter()
    rows = Run(run_dir).trajectories().num_rows
    return time.perf_counter() - start, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", type=Path, help="a copy of a run (its run index files are removed)")
    args = parser.parse_args()
    for folder in run_index.folders(args.run):
        shutil.rmtree(folder, ignore_errors=True)
    (args.run / run_index.LEGACY_RUN_INDEX).unlink(missing_ok=True)
    shards = sum(1 for _ in args.run.glob("spans/*/*/*.parquet"))
    load = os.getloadavg()[0]
    cold, rows = listing_seconds(args.run)
    warm, again = listing_seconds(args.run)
    assert rows == again, (rows, again)
    segments, _ = run_index.find(args.run)
    largest = max(segments, key=lambda s: len(s.covered))
    largest.path.write_bytes(largest.path.read_bytes()[:100])
    damaged, third = listing_seconds(args.run)
    assert rows == third, (rows, third)
    print(
        f"shards {shards}  trajectories {rows}  load {load:.1f}  cold {cold:.1f} s  warm {warm:.2f} s  "
        f"one segment of {len(largest.covered)} shards damaged {damaged:.2f} s  ({len(segments)} segments)"
    )


if __name__ == "__main__":
    main()
