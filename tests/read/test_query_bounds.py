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
from support import run_cli as cli

from rlreplay.read import where

SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "verl-toolagent-smollm2"
#: A query that runs for minutes: a cross join counted.
ENDLESS = "(SELECT count(*) FROM range(1000000) a, range(1000000) b WHERE (a.range * b.range) % 7 = 3)"


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
        # a result larger than the limit streams: never gathered, the table shows its first rows
        wide = "SELECT a.range, b.range FROM range(20000) a, range(20000) b"
        rc, out, err = cli(capsys, "sql", SAMPLE, wide, "--memory-limit", "50MB")
        assert rc == 0 and out.endswith(
            "(first 1000 rows shown; more follow: --limit N, or --json for every row)\n"
        )
        rc, out, err = cli(capsys, "sql", SAMPLE, "SELECT 1", "--memory-limit", "lots")
        assert rc == 2 and "--memory-limit" in err
    finally:
        where.set_memory_limit(where.DEFAULT_MEMORY_BYTES)
    assert list(tmp_path.iterdir()) == []


def _shown_limit(nbytes: int) -> str:
    """How DuckDB itself shows a memory limit of ``nbytes`` (a connection of its own)."""
    import duckdb

    with duckdb.connect(":memory:", config={"memory_limit": f"{nbytes}B"}) as con:
        return con.sql("SELECT current_setting('memory_limit')").fetchall()[0][0]


def _limit_is(nbytes: int) -> str:
    """A --where expression that holds only on a connection whose memory limit is ``nbytes``."""
    return f"current_setting('memory_limit') = '{_shown_limit(nbytes)}'"


def test_where_and_stats_connections_are_limited_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """``--where`` (in ``ls`` and ``stats``) and the ``stats`` query run on connections holding the
    default limit, asked of DuckDB on those very connections."""
    from rlreplay.read.open import open_run

    other = 300_000_000
    assert _shown_limit(other) != _shown_limit(where.DEFAULT_MEMORY_BYTES)
    total = open_run(SAMPLE).trajectories().num_rows
    rc, out, err = cli(capsys, "ls", SAMPLE, "--where", _limit_is(where.DEFAULT_MEMORY_BYTES), "--json")
    assert rc == 0 and len(out.splitlines()) == total > 0, err
    rc, out, err = cli(capsys, "ls", SAMPLE, "--where", _limit_is(other), "--json")
    assert rc == 0 and out == "", err
    rc, everything, err = cli(capsys, "stats", SAMPLE, "--json")
    assert rc == 0 and everything, err
    rc, out, err = cli(capsys, "stats", SAMPLE, "--where", _limit_is(where.DEFAULT_MEMORY_BYTES), "--json")
    assert (rc, out) == (0, everything), err
    con = where.shared_connection()  # the connection ``stats`` queried on (this thread's)
    assert con.sql("SELECT current_setting('memory_limit')").fetchall()[0][0] == _shown_limit(
        where.DEFAULT_MEMORY_BYTES
    )


def test_the_uis_queries_are_limited_by_ui_memory_limit() -> None:
    """``rlreplay ui --memory-limit``: the where box runs on the server's connections, which hold
    that limit (and not the default)."""
    import urllib.parse
    import urllib.request

    from rlreplay.read.open import open_run

    total = open_run(SAMPLE).trajectories().num_rows
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", "ui", str(SAMPLE), "--port", "0", "--memory-limit", "300MB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        url = proc.stdout.readline().split()[2]  # type: ignore[union-attr]
        counts = {}
        for nbytes in (300_000_000, where.DEFAULT_MEMORY_BYTES):
            query = urllib.parse.urlencode({"where": _limit_is(nbytes)})
            with urllib.request.urlopen(f"{url}r/{SAMPLE.name}/trajectories?{query}", timeout=60) as page:
                text = page.read().decode()
            counts[nbytes] = int(text.split('<span id="count">')[1].split("<")[0])
        assert counts == {300_000_000: total, where.DEFAULT_MEMORY_BYTES: 0}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=20)


def _bytes(shown: str) -> float:
    number, unit = shown.split()
    return float(number) * {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[unit]


# ---- Ctrl-C -----------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sigint_as_on_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    "args",
    [
        ("sql", f"SELECT {ENDLESS} AS n"),
        ("ls", "--where", f"{ENDLESS} > 0"),
        ("stats", "--where", f"{ENDLESS} > 0"),
    ],
    ids=lambda a: " ".join(a[:2] if a[0] != "sql" else a[:1]),
)
def test_ctrl_c_stops_a_query_within_a_second(args: tuple[str, ...]) -> None:
    """Any query: ``sql``'s, and ``--where`` in ``ls`` and ``stats``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay", args[0], str(SAMPLE), *args[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a terminal's Ctrl-C: a suite started in the background inherits SIGINT ignored
        preexec_fn=_sigint_as_on_a_terminal,
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


def test_no_page_of_the_ui_computes_past_its_budget(tmp_path: Path) -> None:
    """Every page of a run, sent an endless where (in every parameter that takes one), answers
    within its budget and leaves nothing computing; the pages that run it say it was stopped.
    Every page runs its queries inside the budget (the wrapper that sets it)."""
    import shutil
    import urllib.parse

    from starlette.routing import Route
    from starlette.testclient import TestClient

    from rlreplay.read.open import open_run
    from rlreplay.ui.app import create_app

    budget = 1.0
    for name in ("a", "b"):
        shutil.copytree(SAMPLE, tmp_path / name)
    ids = open_run(SAMPLE).trajectories()["id"].to_pylist()
    endless = f"{ENDLESS} > 0"
    within = urllib.parse.urlencode({"where": endless})
    params = {  # what each page of a run takes, an endless where in each
        "/r/{run}/": {"where": endless},
        "/r/{run}/trajectories": {"where": endless},
        "/r/{run}/t/{tid}": {"in": within, "where": endless},
        "/r/{run}/group/{tid}": {"where": endless},
        "/r/{run}/prompt": {"sample_index": 0, "validate": "false", "where": endless},
        "/r/{run}/diff": {"a": ids[0], "b": ids[1], "where": endless},
        "/r/{run}/findings": {"where": endless},
        "/r/{run}/mismatch": {"where": endless},
        "/r/{run}/compare": {"with": "b", "where": endless},
        "/r/{run}/api/version": {"where": endless},
        "/r/{run}/alerts": {"where": endless},
    }
    stopped = {"/r/{run}/trajectories"}  # the pages that run the where box
    app = create_app(tmp_path, poll_ms=60_000, query_budget_s=budget)
    pages = [r for r in app.routes if isinstance(r, Route) and r.path.startswith("/r/")]
    assert sorted(r.path for r in pages) == sorted(params)  # a new page is added here
    assert all(getattr(r.endpoint, "__wrapped__", None) for r in pages)  # each inside its budget
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/r/a/trajectories").status_code == 200  # the listing read
        for path, query in params.items():
            url = path.format(run="a", tid=ids[0]) + "?" + urllib.parse.urlencode(query)
            start = time.monotonic()
            page = client.get(url)
            took = time.monotonic() - start
            assert page.status_code in (200, 400, 404) and took < budget + 3.0, (path, took, page.status_code)
            if path in stopped:
                assert page.status_code == 400 and f"stopped after {budget:g} s" in page.text, path
            cpu = time.process_time()
            time.sleep(0.5)
            assert time.process_time() - cpu < 0.2, path  # nothing left computing
