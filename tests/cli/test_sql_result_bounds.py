"""``rlreplay sql`` streams its result: the memory limit bounds the whole process, the result
included (rows are printed as DuckDB makes them, never all held as Python values); the table shows
the first ``--limit`` rows and says when there are more; long lists and texts are read only as far
as their cell shows them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from support import rlreplay_proc

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-toolagent-smollm2"
LIMIT_MB = 50
#: Each process's own peak resident memory, in a parent of its own (this process's children's
#: peak is the largest of every child the suite ever waited for).
PEAK = (
    "import resource, subprocess, sys\n"
    "proc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
    "sys.stderr.buffer.write(proc.stderr)\n"
    "lines = proc.stdout.splitlines()\n"
    "print(proc.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, len(lines))\n"
    "sys.stdout.buffer.write(b'\\n'.join(lines[:3] + lines[-3:]))\n"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sql-bounds") / "run"
    shutil.copytree(SAMPLE, path)
    return path


def peak(run: Path, *args: str) -> tuple[int, int, int, list[bytes]]:
    """Exit code, peak resident bytes, lines printed, and the first and last three of them."""
    command = [sys.executable, "-m", "rlreplay", "sql", str(run), "--memory-limit", f"{LIMIT_MB}MB", *args]
    proc = subprocess.run([sys.executable, "-c", PEAK, *command], capture_output=True, timeout=300)
    head, _, lines = proc.stdout.partition(b"\n")
    rc, nbytes, count = map(int, head.split())
    return rc, nbytes, count, lines.splitlines()


def test_the_memory_limit_bounds_the_printed_result(run: Path) -> None:
    """Results whose Arrow form fits the limit but whose Python form is many times larger (the old
    way, gathered then turned into rows: 1.3 GB for 5M rows at a 50 MB limit): the process's peak
    stays within what ``SELECT 1`` takes plus the limit."""
    rc, baseline, _, _ = peak(run, "SELECT 1 AS x")
    assert rc == 0
    bound = baseline + LIMIT_MB * 10**6

    rc, table_peak, count, lines = peak(run, "SELECT i FROM range(0, 5000000) t(i)")
    assert rc == 0 and table_peak <= bound, (table_peak, baseline)
    assert count == 1 + 1000 + 1  # header, the rows shown, the note
    assert lines[1:3] == [b"0", b"1"] and lines[-2] == b"999"
    assert lines[-1] == b"(first 1000 rows shown; more follow: --limit N, or --json for every row)"

    rows = 1_000_000
    rc, json_peak, count, lines = peak(run, "--json", f"SELECT i, i * 2 AS j FROM range(0, {rows}) t(i)")
    assert rc == 0 and json_peak <= bound, (json_peak, baseline)
    assert count == rows  # every row
    assert [orjson.loads(x) for x in lines] == [
        {"i": i, "j": 2 * i} for i in (0, 1, 2, rows - 3, rows - 2, rows - 1)
    ]


def _sql(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return rlreplay_proc("sql", run, *args)


@pytest.mark.parametrize(("total", "limit"), [(5, 5), (6, 5), (0, 5), (3000, 2500)])
def test_the_table_says_when_it_shows_only_the_first_rows(run: Path, total: int, limit: int) -> None:
    proc = _sql(run, f"SELECT i FROM range(0, {total}) t(i)", "--limit", str(limit))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    shown = min(total, limit)
    assert lines[0] == "i" and lines[1 : 1 + shown] == [str(i) for i in range(shown)]
    if total > limit:
        assert lines[-1] == f"(first {limit} rows shown; more follow: --limit N, or --json for every row)"
    else:
        assert lines[-1] == f"({total} rows)"
    assert len(lines) == shown + 2


def test_long_values_are_previewed_in_the_table_and_whole_in_json(run: Path) -> None:
    query = "SELECT range(0, 200000) AS l, repeat('ab', 100000) AS s, [1, 2] AS short"
    table = _sql(run, query)
    assert table.returncode == 0, table.stderr
    row = table.stdout.splitlines()[1].split()
    assert row[0].startswith("[0,1,2,3,") and row[0].endswith("…") and len(row[0]) == 60
    assert row[1] == "ab" * 29 + "a…"
    assert row[2] == "[1,2]"
    whole = orjson.loads(_sql(run, query, "--json").stdout)
    assert whole == {"l": list(range(200000)), "s": "ab" * 100000, "short": [1, 2]}


def test_a_reader_that_goes_away_stops_the_query_cleanly(run: Path) -> None:
    """``sql --json | head -1``: the query stops with the reader, and DuckDB is let go before the
    process ends (a query thread still inside DuckDB at exit aborts it, or prints leak reports)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlreplay",
            "sql",
            str(run),
            "SELECT i FROM range(0, 100000000) t(i)",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline() == b'{"i":0}\n'
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 1), err  # 1: click's exit on a closed pipe
    assert err == "", err
