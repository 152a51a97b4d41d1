"""Whole-run listing of a run of many shards: cold (no run index) and warm (run index current)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rlreplay.format import index as tindex
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
    for path in tindex.run_index_paths(args.run):
        path.unlink(missing_ok=True)
    shards = sum(1 for _ in args.run.glob("spans/*/*/*.parquet"))
    load = os.getloadavg()[0]
    cold, rows = listing_seconds(args.run)
    warm, again = listing_seconds(args.run)
    assert rows == again, (rows, again)
    print(f"shards {shards}  trajectories {rows}  load {load:.1f}  cold {cold:.1f} s  warm {warm:.2f} s")


if __name__ == "__main__":
    main()
