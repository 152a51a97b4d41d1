"""DuckDB for rlreplay: bounded connections that cannot touch files, and ``--where`` over a listing.

Every query is bounded: DuckDB's memory (:data:`DEFAULT_MEMORY_BYTES` unless the command line
says otherwise, and nothing spilled to disk), the size of its result (the same limit), and its
time: it runs on a helper thread, so that Ctrl-C stops it at once, and within a
:func:`time_budget` (the web UI's) it is stopped when the budget ends. DuckDB is imported when a
query runs, never at import.
"""

from __future__ import annotations

import contextlib
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


def shared_connection() -> Any:
    """This thread's connection for rlreplay's own queries (opening one costs tens of ms)."""
    con = getattr(_local, "con", None)
    if con is None:
        con = _local.con = connect()
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
    con = shared_connection()
    view = with_aliases(merged(table), expr)
    numbered = view.append_column(ROW_COLUMN, pa.array(range(view.num_rows), pa.int64()))
    con.register(_LISTING, numbered)  # a subquery may read it too: (SELECT avg(reward) FROM trajectories)
    try:
        relation = con.table(_LISTING).filter(condition)
        rows = run_query(con, relation.project(ROW_COLUMN).order(ROW_COLUMN), what)[ROW_COLUMN]
    except duckdb.Error as exc:  # a column it names, or a type, DuckDB cannot bind
        raise QueryError(f"{what}: {one_line(exc)}") from None
    finally:
        con.unregister(_LISTING)
    return ops.take(table, rows)


_LISTING = "trajectories"
