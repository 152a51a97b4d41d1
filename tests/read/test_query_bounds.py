"""DuckDB runs bounded: ``--where`` is one expression, never pasted into SQL; a query's memory
(its result included) has a default limit the command line can change, and nothing is spilled to
disk; Ctrl-C stops ``sql`` within a second without a traceback; every query of the web UI stops
when its time budget ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlreplay.cli.main import main
from rlreplay.read import where

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-toolagent-smollm2"
#: A query that runs for minutes: a cross join counted.
ENDLESS = "(SELECT count(*) FROM range(1000000) a, range(1000000) b WHERE (a.range * b.range) % 7 = 3)"


def cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# ---- --where: one expression ---------------------------------------------------------------------

#: Text that closes the expression and goes on as SQL: every one is refused.
NOT_ONE_EXPRESSION = [
    "1=1) OR (1=1",
    "reward > 0) OR (true",
    "false) UNION ALL SELECT _rlreplay_row FROM trajectories --",
    "reward > 0 ORDER BY 1",
    "reward > 0 LIMIT 1",
    "true GROUP BY step",
    "1=1; SELECT 1",
    "true) --",
    "reward > 0 /* ) OR (1=1 */) OR (true",
    ")",
]


@pytest.mark.parametrize("expr", NOT_ONE_EXPRESSION)
def test_where_is_one_expression(expr: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "ls", SAMPLE, "--where", expr, "--json")
    assert rc == 2 and out == "", out
    assert err.startswith("rlreplay: error: --where") and err.count("\n") == 1, err


_ATOMS = st.sampled_from(
    ["reward > 0", "tool_errors >= 1", "step = 2", "validate", "model_calls < 3", "true"]
)
_GLUE = st.sampled_from([") OR (", ") AND (", " OR ", " AND ", ") ", " (", ";", " ORDER BY ", ")) OR ((", ""])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.tuples(_ATOMS, _GLUE), min_size=1, max_size=4))
def test_where_selects_exactly_what_the_expression_means(parts: list[tuple[str, str]]) -> None:
    """Whatever the text, ``--where`` keeps the rows for which it holds as one expression (the
    rows Python computes here), or refuses it: never the rows of a query it was pasted into."""
    from rlreplay.errors import QueryError
    from rlreplay.read.open import open_run

    text = "".join(atom + glue for atom, glue in parts).strip()
    listing = open_run(SAMPLE).trajectories()
    try:
        kept = where.filter_where(listing, text)["id"].to_pylist()
    except QueryError:
        return
    rows = listing.to_pylist()
    expected = [r["id"] for r in rows if _holds(text, r)]
    assert kept == expected, text


def _holds(text: str, row: dict) -> bool:
    """The expression evaluated in Python: only well-formed texts get here."""
    names = {
        "reward": row["reward"] if row["reward"] is not None else float("nan"),
        "tool_errors": row["tool_errors"],
        "step": row["step"],
        "validate": row["validate"],
        "model_calls": row["model_calls"],
        "true": True,
    }
    python = text.replace(" OR ", " or ").replace(" AND ", " and ").replace(" = ", " == ")
    python = python.rstrip().removesuffix(";")  # one statement may end with its semicolon
    return bool(eval(python, {"__builtins__": {}}, names))  # our own atoms and glue


# ---- memory -----------------------------------------------------------------------------------


def test_memory_is_limited_by_default_and_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    query = "SELECT current_setting('memory_limit') AS limit, current_setting('temp_directory') AS spill"
    rc, out, err = cli(capsys, "sql", SAMPLE, query, "--json")
    assert rc == 0, err
    shown = json.loads(out)
    assert _bytes(shown["limit"]) == pytest.approx(where.DEFAULT_MEMORY_BYTES, rel=0.03)  # shown to 0.1 GiB
    assert shown["spill"] == ""  # nothing spilled to disk: a query that needs more memory fails
    try:
        rc, out, err = cli(capsys, "sql", SAMPLE, query, "--json", "--memory-limit", "300MB")
        assert rc == 0, err
        assert _bytes(json.loads(out)["limit"]) == pytest.approx(300e6, rel=0.01)
        # a sort larger than the limit fails in one line, and writes nothing
        big = "SELECT count(*) FROM (SELECT md5(range::VARCHAR) AS h FROM range(3000000) ORDER BY h)"
        rc, out, err = cli(capsys, "sql", SAMPLE, big, "--memory-limit", "40MB")
        assert rc == 2 and err.startswith("rlreplay: error: sql:") and err.count("\n") == 1, err
        # a result larger than the limit is refused, not gathered
        wide = "SELECT a.range, b.range FROM range(20000) a, range(20000) b"
        rc, out, err = cli(capsys, "sql", SAMPLE, wide, "--memory-limit", "50MB")
        assert rc == 2 and "larger than the memory limit" in err and err.count("\n") == 1, err
        rc, out, err = cli(capsys, "sql", SAMPLE, "SELECT 1", "--memory-limit", "lots")
        assert rc == 2 and "--memory-limit" in err
    finally:
        where.set_memory_limit(where.DEFAULT_MEMORY_BYTES)
    assert list(tmp_path.iterdir()) == []


def _bytes(shown: str) -> float:
    number, unit = shown.split()
    return float(number) * {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[unit]


# ---- Ctrl-C -----------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_ctrl_c_stops_sql_within_a_second(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "sql", str(SAMPLE), f"SELECT {ENDLESS} AS n"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        started = time.monotonic()
        while _cpu_seconds(proc.pid) < 3.0:  # the query is computing (start-up takes about 1 s)
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() - started < 120
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 1.0, took
    assert proc.returncode == 130 and out == ""
    assert err == "rlreplay: interrupted\n"


# ---- the UI's time budget ---------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1.0, None])
def test_every_ui_query_has_a_time_budget(budget: float | None, tmp_path: Path) -> None:
    """A where box with an endless query answers when the budget ends (the default one too), and
    nothing keeps computing after the page was answered."""
    import shutil
    import urllib.parse

    from starlette.testclient import TestClient

    from rlreplay.ui.app import QUERY_SECONDS, create_app

    shutil.copytree(SAMPLE, tmp_path / SAMPLE.name)
    kw = {} if budget is None else {"query_budget_s": budget}
    seconds = QUERY_SECONDS if budget is None else budget
    with TestClient(create_app(tmp_path, poll_ms=60_000, **kw)) as client:
        assert client.get(f"/r/{SAMPLE.name}/trajectories").status_code == 200  # the listing read
        query = urllib.parse.urlencode({"where": f"{ENDLESS} > 0"})
        start = time.monotonic()
        page = client.get(f"/r/{SAMPLE.name}/trajectories?{query}")
        took = time.monotonic() - start
        assert page.status_code == 400 and f"stopped after {seconds:g} s" in page.text
        assert seconds <= took < seconds + 3.0
        cpu = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - cpu < 0.3  # the query was stopped, not left running
