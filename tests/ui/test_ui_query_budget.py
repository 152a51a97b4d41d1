"""The UI's time budget stops a where box's query even where DuckDB does not look at its interrupt
(one chunk of rows computing for minutes): the page answers when the budget ends, and nothing
keeps computing."""

from __future__ import annotations

import os
import shutil
import time
import urllib.parse
from pathlib import Path

from ui_support import SHOWCASE, cli_json

#: one chunk of rows (the whole listing), each a levenshtein of strings of ~60,000 by ~2,900
#: characters: minutes in one call DuckDB does not interrupt
UNINTERRUPTIBLE = "levenshtein(repeat(worker, 3000 + step), repeat(id, 90)) > 0"


def where_processes() -> dict[int, int]:
    """{pid: CPU ticks so far} of this process's children that run where queries."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if b"rlreplay.read.where" in cmdline and int(stat[1]) == os.getpid() and stat[0] != "Z":
            found[int(entry.name)] = int(stat[11]) + int(stat[12])
    return found


def test_the_budget_ends_a_query_duckdb_would_not_interrupt(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from rlreplay.ui.app import create_app

    shutil.copytree(SHOWCASE, tmp_path / SHOWCASE.name)
    budget = 1.0
    base = f"/r/{SHOWCASE.name}/trajectories"
    with TestClient(create_app(tmp_path, poll_ms=60_000, query_budget_s=budget)) as client:
        assert client.get(base).status_code == 200  # the listing read
        start = time.monotonic()
        page = client.get(f"{base}?{urllib.parse.urlencode({'where': UNINTERRUPTIBLE})}")
        took = time.monotonic() - start
        assert page.status_code == 400 and f"stopped after {budget:g} s" in page.text
        # the budget, and a where process's start (not counted in it: ~0.3 s, more on a loaded machine)
        assert budget <= took < budget + 8.0, took
        before = where_processes()
        time.sleep(1.0)
        after = where_processes()
        busy = {pid for pid, ticks in after.items() if ticks - before.get(pid, ticks) > 20}
        assert not busy, (before, after)  # the query was ended with its process, not left running

        # the where box answers again, as `ls --where` does
        expected = len(
            cli_json("ls", str(SHOWCASE), "--where", "reward > 0 AND step >= 2", "--limit", "1000")
        )
        page = client.get(f"{base}?{urllib.parse.urlencode({'where': 'reward > 0 AND step >= 2'})}")
        assert page.status_code == 200
        assert f'<span id="count">{expected}</span>' in page.text
        page = client.get(f"{base}?{urllib.parse.urlencode({'where': 'no_such_column > 1'})}")
        assert page.status_code == 400 and "no_such_column" in page.text and "Traceback" not in page.text
