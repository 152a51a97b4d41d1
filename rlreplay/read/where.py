"""DuckDB for rlreplay: bounded connections that cannot touch files, and ``--where`` over a listing.

Every query is bounded: DuckDB's memory (:data:`DEFAULT_MEMORY_BYTES` unless the command line
says otherwise, and nothing spilled to disk), the size of its result (the same limit), and its
time: it runs on a helper thread, so that Ctrl-C stops it at once, and within a
:func:`time_budget` (the web UI's) it is stopped when the budget ends. DuckDB is imported when a
query runs, never at import.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import pyarrow as pa

from rlreplay.errors import QueryError, install_hint
from rlreplay.format import arrow_ops as ops
from rlreplay.format.index import merged
from rlreplay.format.keys import ALIASES

ROW_COLUMN = "_rlreplay_row"


def duckdb_module() -> Any:
    try:
        import duckdb
    except ImportError as exc:
        raise QueryError(f"queries need DuckDB: {install_hint('query')}") from exc
    return duckdb


def one_line(exc: BaseException) -> str:
    """DuckDB's message without the echoed query and caret lines."""
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = [line for line in lines if line and not line.startswith("LINE ") and set(line) != {"^"}]
    return " ".join(kept)[:400] or type(exc).__name__


#: DuckDB's memory, and the most a query's result may hold, unless ``--memory-limit`` says otherwise.
DEFAULT_MEMORY_BYTES = 2 << 30  # 2 GiB
_memory = {"bytes": DEFAULT_MEMORY_BYTES}
#: Seconds a query may run in this context (None: until done or Ctrl-C); see :func:`time_budget`.
_budget: ContextVar[float | None] = ContextVar("rlreplay_query_budget", default=None)
#: How often the caller's thread looks up from a running query (for Ctrl-C and the budget).
_POLL_S = 0.05
#: Rows per batch of a result (its size is checked batch by batch).
_BATCH_ROWS = 8192


def set_memory_limit(nbytes: int) -> None:
    """DuckDB's memory (and the largest result) for connections opened from now on."""
    if nbytes < 1:
        raise QueryError(f"the memory limit must be at least 1 byte (got {nbytes})")
    _memory["bytes"] = nbytes
    _local.__dict__.clear()  # this thread's shared connection is opened again, with the new limit


def memory_limit() -> int:
    return _memory["bytes"]


def current_budget() -> float | None:
    """Seconds a query may run in this context (None: until done or Ctrl-C)."""
    return _budget.get()


@contextlib.contextmanager
def time_budget(seconds: float | None) -> Iterator[None]:
    """Queries run inside stop after ``seconds`` (a :class:`QueryError` says so)."""
    token = _budget.set(seconds)
    try:
        yield
    finally:
        _budget.reset(token)


def connect() -> Any:
    """An in-memory DuckDB connection that cannot touch files, within the memory limit (it spills
    nothing to disk: a query that needs more fails)."""
    duckdb = duckdb_module()
    config = {
        "enable_external_access": False,
        "temp_directory": "",
        "memory_limit": f"{_memory['bytes']}B",
        "lock_configuration": True,
    }
    return duckdb.connect(":memory:", config=config)


_local = threading.local()
_databases: dict[int, Any] = {}  # memory limit -> an open in-memory database (its first connection)
_databases_lock = threading.Lock()


def query_connection() -> Any:
    """A connection of its own for one query (what it registers and its temporary views are its
    own), to an in-memory database that this process's queries share at the current memory limit:
    opening a database costs ~15 ms, a connection to an open one nothing."""
    limit = _memory["bytes"]
    with _databases_lock:
        database = _databases.get(limit)
        if database is None:
            database = _databases[limit] = connect()
        return database.cursor()


def shared_connection() -> Any:
    """This thread's connection for rlreplay's own queries (opening one costs tens of ms)."""
    con = getattr(_local, "con", None)
    if con is None:
        con = _local.con = query_connection()
    return con


def run_query(con: Any, query: Any, what: str) -> pa.Table:
    """The rows of ``query`` (SQL text, or a DuckDB relation of ``con``) as an Arrow table.

    It runs on a helper thread while this one waits: Ctrl-C (KeyboardInterrupt) interrupts it
    within a fraction of a second, so does the end of the :func:`time_budget`; a result larger
    than the memory limit is refused. DuckDB's errors become one-line :class:`QueryError` s."""
    budget = _budget.get()
    done = threading.Event()
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            relation = con.sql(query) if isinstance(query, str) else query
            box["table"] = pa.table({}) if relation is None else _collect(relation)
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=work, name="rlreplay-query", daemon=True)
    deadline = None if budget is None else time.monotonic() + budget
    worker.start()
    try:
        while not done.wait(_POLL_S):
            if deadline is not None and time.monotonic() >= deadline:
                con.interrupt()
                done.wait()
                raise QueryError(f"{what}: stopped after {budget:g} s, the time a query may take here")
    except KeyboardInterrupt:
        con.interrupt()
        done.wait(1.0)
        raise
    error = box.get("error")
    if error is None:
        return box["table"]
    if isinstance(error, QueryError):
        raise QueryError(f"{what}: {error}") from None
    if isinstance(error, (duckdb_module().Error, pa.ArrowException, OSError)):  # Arrow's: as rows stream
        raise QueryError(f"{what}: {one_line(error)}") from None
    raise error


def _collect(relation: Any) -> pa.Table:
    """A relation's rows, batch by batch, refused (QueryError) once they pass the memory limit."""
    limit = _memory["bytes"]
    reader = relation.to_arrow_reader(_BATCH_ROWS)
    batches, size = [], 0
    for batch in reader:
        size += batch.nbytes
        if size > limit:
            raise QueryError(
                f"the result is larger than the memory limit ({limit:,} bytes); ask for fewer rows "
                "or columns (LIMIT), or raise --memory-limit"
            )
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=reader.schema)


def with_aliases(table: pa.Table, text: str, leave: tuple[str, ...] = ()) -> pa.Table:
    """``table`` with a column for each other name of one of its columns that ``text`` (SQL) names:
    ``adv`` for ``advantage``, ``sample`` for ``sample_index``, ... (``leave``: names that stand for
    something else in ``text``)."""
    for alias, name in ALIASES.items():
        if (
            alias not in leave
            and alias not in table.column_names
            and name in table.column_names
            and re.search(rf"\b{alias}\b", text, re.IGNORECASE)
        ):
            table = table.append_column(alias, table[name])
    return table


def filter_where(table: pa.Table, expr: str) -> pa.Table:
    """Rows of a listing for which the SQL boolean ``expr`` holds, in their order (a column may be
    named by an alias). ``expr`` is parsed as one expression on its own, never pasted into a query:
    ``1=1) OR (1=1`` is refused."""
    duckdb = duckdb_module()
    what = f"--where {expr!r}"
    try:
        condition = duckdb.SQLExpression(expr)
    except duckdb.Error as exc:
        raise QueryError(f"{what}: not a single expression ({one_line(exc)})") from None
    view = with_aliases(merged(table), expr)
    numbered = view.append_column(ROW_COLUMN, pa.array(range(view.num_rows), pa.int64()))
    budget = _budget.get()
    if budget is not None:  # DuckDB checks interrupt() between chunks only: a process can be ended
        return ops.take(table, _rows_elsewhere(numbered, expr, what, budget))
    return ops.take(table, _rows_here(numbered, condition, what))


def _rows_here(numbered: pa.Table, condition: Any, what: str) -> pa.Array:
    """The row numbers (``ROW_COLUMN``) of ``numbered`` where ``condition`` holds, in order."""
    duckdb = duckdb_module()
    con = shared_connection()
    con.register(_LISTING, numbered)  # a subquery may read it too: (SELECT avg(reward) FROM trajectories)
    try:
        relation = con.table(_LISTING).filter(condition)
        return run_query(con, relation.project(ROW_COLUMN).order(ROW_COLUMN), what)[ROW_COLUMN]
    except duckdb.Error as exc:  # a column it names, or a type, DuckDB cannot bind
        raise QueryError(f"{what}: {one_line(exc)}") from None
    finally:
        con.unregister(_LISTING)


_LISTING = "trajectories"


# ---- a --where within a time budget runs in a process of its own ----------------------------
#
# DuckDB looks at interrupt() between chunks of rows: one chunk's expression (a levenshtein of
# long strings, a list of millions) runs to its end first, for minutes. A where within a time
# budget (the web UI's) runs in a child process that is ended when the budget ends.

#: idle where processes kept for the next query (a process starts in ~0.3 s)
_idle: list[Any] = []
_idle_lock = threading.Lock()
_IDLE_KEPT = 2
#: seconds a where process may take to start (not counted in the budget)
_START_S = 60.0
_READY = b"R"


def _rows_elsewhere(numbered: pa.Table, expr: str, what: str, budget: float) -> pa.Array:
    """``_rows_here`` in a where process, ended (killed) when ``budget`` seconds of the query end."""
    proc = _take_process()
    started, done = threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    def talk() -> None:
        try:
            if getattr(proc, "rlreplay_new", False) and proc.stdout.read(1) != _READY:
                raise EOFError("it did not start")
            started.set()
            _send(proc.stdin, json.dumps({"expr": expr, "what": what, "memory": _memory["bytes"]}).encode())
            _send(proc.stdin, _ipc(numbered))
            proc.stdin.flush()
            answer = json.loads(_receive(proc.stdout))
            if "error" in answer:
                box["error"] = answer["error"]
            else:
                box["rows"] = pa.ipc.open_stream(_receive(proc.stdout)).read_all()[ROW_COLUMN]
        except (OSError, EOFError, ValueError, pa.ArrowException) as exc:
            box["ended"] = f"{what}: the query's process ended ({one_line(exc)})"
        finally:
            started.set()
            done.set()

    threading.Thread(target=talk, name="rlreplay-where", daemon=True).start()
    try:
        started.wait(_START_S)
        deadline = time.monotonic() + budget
        while not done.wait(_POLL_S):
            if time.monotonic() >= deadline:
                _end(proc)
                raise QueryError(f"{what}: stopped after {budget:g} s, the time a query may take here")
    except KeyboardInterrupt:
        _end(proc)
        raise
    if "ended" in box:
        _end(proc)
        raise QueryError(box["ended"])
    _keep(proc)
    if "error" in box:
        raise QueryError(box["error"])
    return box["rows"]


def _take_process() -> Any:
    """An idle where process, else a new one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    with _idle_lock:
        while _idle:
            proc = _idle.pop()
            if proc.poll() is None:
                return proc
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    here = str(Path(__file__).resolve().parents[2])  # the folder holding the rlreplay package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlreplay.read.where"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    proc.rlreplay_new = True  # type: ignore[attr-defined]
    return proc


def _keep(proc: Any) -> None:
    """Keep a where process that answered for the next query (a few at most)."""
    proc.rlreplay_new = False
    with _idle_lock:
        if len(_idle) < _IDLE_KEPT:
            _idle.append(proc)
            return
    _end(proc)


def _end(proc: Any) -> None:
    """End a where process now, whatever it is computing."""
    import subprocess

    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    for pipe in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            pipe.close()


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _send(out: Any, data: bytes) -> None:
    out.write(len(data).to_bytes(8, "little"))
    out.write(data)


def _receive(source: Any) -> bytes:
    size = int.from_bytes(_exactly(source, 8), "little")
    return _exactly(source, size)


def _exactly(source: Any, n: int) -> bytes:
    data = source.read(n)
    if len(data) != n:
        raise EOFError("the other end closed")
    return data


def serve() -> None:
    """A where process: answers ``_rows_elsewhere``'s queries (stdin, stdout) until stdin ends."""
    import os
    import sys

    duckdb = duckdb_module()
    source = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")  # the answers' pipe: whatever else writes to stdout goes to stderr
    os.dup2(2, 1)
    out.write(_READY)
    out.flush()
    while True:
        try:
            request = json.loads(_receive(source))
            numbered = pa.ipc.open_stream(_receive(source)).read_all()
        except EOFError:
            return
        what = request["what"]
        try:
            if request["memory"] != _memory["bytes"]:
                set_memory_limit(request["memory"])
            rows = _rows_here(numbered, duckdb.SQLExpression(request["expr"]), what)
        except QueryError as exc:
            _send(out, json.dumps({"error": str(exc)}).encode())
        except Exception as exc:  # one line to the page, never a traceback
            _send(out, json.dumps({"error": f"{what}: {one_line(exc)}"}).encode())
        else:
            _send(out, b"{}")
            _send(out, _ipc(pa.table({ROW_COLUMN: rows})))
        out.flush()


if __name__ == "__main__":
    serve()
