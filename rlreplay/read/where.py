"""DuckDB for rlreplay: connections that cannot touch files, and ``--where`` over a listing.

DuckDB is imported when a query runs, never at import.
"""

from __future__ import annotations

import re
import threading
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


def connect() -> Any:
    """An in-memory DuckDB connection that cannot touch files."""
    duckdb = duckdb_module()
    return duckdb.connect(":memory:", config={"enable_external_access": False, "lock_configuration": True})


_local = threading.local()


def shared_connection() -> Any:
    """This thread's connection for rlreplay's own queries (opening one costs tens of ms)."""
    con = getattr(_local, "con", None)
    if con is None:
        con = _local.con = connect()
    return con


def run_query(con: Any, text: str, what: str) -> pa.Table:
    duckdb = duckdb_module()
    try:
        relation = con.sql(text)
        if relation is None:
            return pa.table({})
        return relation.to_arrow_table()
    except duckdb.Error as exc:
        raise QueryError(f"{what}: {one_line(exc)}") from None


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
    named by an alias)."""
    duckdb = duckdb_module()
    con = shared_connection()
    view = with_aliases(merged(table), expr)
    query = f"SELECT {ROW_COLUMN} FROM _listing AS trajectories WHERE ({expr}\n) ORDER BY {ROW_COLUMN}"
    try:
        statements = con.extract_statements(query)
    except duckdb.Error as exc:
        raise QueryError(f"--where {expr!r}: {one_line(exc)}") from None
    if len(statements) != 1:
        raise QueryError(f"--where {expr!r}: not a single expression")
    con.register("_listing", view.append_column(ROW_COLUMN, pa.array(range(view.num_rows), pa.int64())))
    try:
        rows = run_query(con, query, f"--where {expr!r}")[ROW_COLUMN]
    finally:
        con.unregister("_listing")
    return ops.take(table, rows)
