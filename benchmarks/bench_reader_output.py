"""What a reader does after the listing of a big run: ``ls --json``'s lines, and the UI's look at
the run's files (each page and each live poll), each against the plain way of doing it."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from rlreplay.format.schema import KEY_STR, KEYS
from rlreplay.model import listing_json
from rlreplay.read.open import open_run
from rlreplay.read.selection import listing
from rlreplay.read.store import folder_signature
from rlreplay.shards.layout import LEASE_DIR, SPANS_DIR


def row_by_row(table: Any) -> str:
    """The plain way: a dict per row, keys merged, ``orjson.dumps`` per row."""
    out = []
    for row in table.to_pylist():
        for key in KEYS:
            row[key] = row[key] if row[key] is not None else row.pop(KEY_STR[key])
            row.pop(KEY_STR[key], None)
        out.append(orjson.dumps(row).decode() + "\n")
    return "".join(out)


def every_file(run_dir: Path) -> tuple[Any, ...]:
    """The plain way: every span and counter file looked at (scandir, stat), sorted."""
    out = []
    stack = [os.path.join(run_dir, SPANS_DIR), os.path.join(run_dir, LEASE_DIR)]
    while stack:
        for entry in os.scandir(stack.pop()):
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            else:
                st = entry.stat(follow_symlinks=False)
                out.append((entry.path, st.st_size, st.st_mtime_ns))
    out.sort()
    return tuple(out)


def median_s(work: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", type=Path, help="a run directory")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    table = listing(open_run(args.run))
    assert "".join(listing_json(table)) == row_by_row(table)
    folder_signature(args.run)  # the UI's first look (at start-up)
    assert set(folder_signature(args.run)) == set(every_file(args.run))
    load = os.getloadavg()[0]
    rows = [
        ("`ls --json` lines", median_s(lambda: "".join(listing_json(table)), args.repeats),
         median_s(lambda: row_by_row(table), args.repeats)),
        ("UI look at the files", median_s(lambda: folder_signature(args.run), args.repeats),
         median_s(lambda: every_file(args.run), args.repeats)),
    ]  # fmt: skip
    print(f"{table.num_rows} trajectories, load (1 min) {load:.1f}")
    print("| work | rlreplay | plain way | rlreplay / plain |\n|---|---:|---:|---:|")
    for name, ours, plain in rows:
        print(f"| {name} | {ours:.2f} s | {plain:.2f} s | {ours / plain:.2f}x |")


if __name__ == "__main__":
    main()
