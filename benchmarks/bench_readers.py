"""The chaos soak's reader commands on a large run, whole processes: ``ls --json``, ``stats``,
``show ID`` and ``sql 'SELECT count(*) ...'``, against DuckDB counting the run's trajectories
straight from its span files (what a user without rlreplay would run), and optionally against
rlreplay as of an older git revision. The run index is current (each command lists the run
first; the first round writes what is missing).

    python benchmarks/bench_readers.py RUN --before REV --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_cli_startup import ENV, measure, older_rlreplay, table

DUCKDB_COUNT = """
import duckdb, sys
files = f"{sys.argv[1]}/spans/*/*/*.parquet"
duckdb.sql(f"select count(distinct trajectory_id) from read_parquet('{files}')").fetchall()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run", type=Path, help="a run directory (e.g. the one soak.py --keep leaves)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", metavar="REV", help="also time the commands of git revision REV")
    args = parser.parse_args()
    run = str(args.run.resolve())
    listing = subprocess.run(
        [sys.executable, "-m", "rlreplay", "ls", run, "--json", "--limit", "1"],
        capture_output=True,
        text=True,
        check=True,
        env=ENV,
    )
    some_id = json.loads(listing.stdout.splitlines()[0])["id"]
    commands = {
        "ls RUN --json": ["ls", run, "--json"],
        "stats RUN": ["stats", run],
        "show ID --run RUN": ["show", some_id, "--run", run],
        "sql RUN 'SELECT count(*) ...'": ["sql", run, "SELECT count(*) AS n FROM trajectories", "--json"],
    }
    peer = "DuckDB: count(distinct trajectory_id) over the span files"
    cases = [(peer, [sys.executable, "-c", DUCKDB_COUNT, run], ENV)]
    versions = [("", ENV)]
    if args.before:
        versions.append((f" ({args.before})", {**ENV, "PYTHONPATH": str(older_rlreplay(args.before))}))
    for label, argv in commands.items():
        for suffix, env in versions:
            cases.append((f"rlreplay {label}{suffix}", [sys.executable, "-m", "rlreplay", *argv], env))
    shards = sum(1 for _ in args.run.glob("spans/*/*/*.parquet"))
    results = measure(cases, args.repeats)
    table(
        f"{shards:,} shards, load average {os.getloadavg()[0]:.1f} at the end; base: the peer",
        peer,
        results,
        args.repeats,
    )


if __name__ == "__main__":
    main()
