"""SQL over a run with DuckDB: the views ``trajectories`` and ``spans``, ``--where``, per-step stats.

DuckDB is imported when a query runs, never at import. Connections read only what they are
given: external file access is switched off (a query cannot read or write files), the listing
is an in-memory Arrow table and ``spans`` is an Arrow dataset over the run's span files, so a
query reads only the columns it names.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from rlreplay.errors import QueryError
from rlreplay.format.index import merged
from rlreplay.format.keys import KEYS
from rlreplay.format.schema import SPAN_SCHEMA
from rlreplay.read.selection import Selection
from rlreplay.read.where import (
    connect,
    current_budget,
    duckdb_module,
    one_line,
    query_connection,
    run_query,
    shared_connection,
    with_aliases,
)

#: Rows per batch of a streamed result, and how often the reading thread looks up from a query
#: (for Ctrl-C and the time budget).
STREAM_BATCH_ROWS, POLL_S = 8192, 0.05
#: Statements run on the process's shared database; any other (``CREATE``, ``EXPLAIN ANALYZE``
#: of one, ...) opens one of its own.
_READ_ONLY = frozenset({"SELECT"})
#: The columns of :func:`stats`, in order.
STATS_COLUMNS = (
    "step",
    "validate",
    "trajectories",
    "groups",
    "reward_mean",
    "reward_std",
    "frac_reward_positive",
    "frac_groups_zero_std",
    "response_tokens_mean",
    "response_tokens_p95",
    "model_calls_mean",
    "tool_calls_mean",
    "tool_error_rate",
    "error_rate",
    "duration_p50_s",
    "duration_p95_s",
    "advantage_mean",
    "advantage_std",
    "logprob_diff_mean",
    "logprob_diff_p95",
    "importance_ratio_p5",
    "importance_ratio_p95",
)


def _spans_table(run: Any) -> Any:
    """The run's span rows as an Arrow dataset: sealed files scanned lazily (format 1 files get
    the format 2 columns as nulls), live files read."""
    import pyarrow.dataset as ds

    sealed, partials = run.span_files(fetch=True)  # a run on an object store: into its cache first
    good = [str(path) for path in run.whole_shards(sealed)]  # checksums verified first
    # and pages whose own checksum does not match are refused as they are read
    checked = ds.ParquetFileFormat(
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
    )
    parts = [ds.dataset(good, schema=SPAN_SCHEMA, format=checked)] if good else []
    live = [t for t in (run.file_rows(path) for path in partials) if t is not None]
    if live:
        parts.append(ds.dataset([t.cast(SPAN_SCHEMA) for t in live], schema=SPAN_SCHEMA))
    if not parts:
        return SPAN_SCHEMA.empty_table()
    return parts[0] if len(parts) == 1 else ds.dataset(parts)


def register_spans(con: Any, run: Any) -> None:
    """View ``spans``: every span row, key values merged as in the listing; ``attributes``, ``inputs``,
    ``output`` are the stored JSON text (token arrays stand there as placeholders pointing into the
    typed ``token_*`` list columns)."""
    con.register("_spans", _spans_table(run))
    names = [row[0] for row in con.sql("DESCRIBE _spans").fetchall()]
    present = [(key, f"{key}_str") for key in KEYS if f"{key}_str" in names]
    if not present:
        con.sql("CREATE OR REPLACE TEMP VIEW spans AS SELECT * FROM _spans")
        return
    probe = ", ".join(f"bool_or({s} IS NOT NULL) AS {s}" for _, s in present)
    found = run_query(con, f"SELECT {probe} FROM _spans", "sql").to_pylist()[0]  # Ctrl-C stops it too
    has_strings = [found[s] for _, s in present]
    replace = [
        f"coalesce(CAST({key} AS VARCHAR), {str_key}) AS {key}"
        for (key, str_key), strings in zip(present, has_strings)
        if strings
    ]
    drop = ", ".join(s for _, s in present)
    replaced = f" REPLACE ({', '.join(replace)})" if replace else ""
    con.sql(f"CREATE OR REPLACE TEMP VIEW spans AS SELECT * EXCLUDE ({drop}){replaced} FROM _spans")


def register_trajectories(con: Any, table: pa.Table, query: str = "") -> None:
    """View ``trajectories``: the listing's rows with merged key values (the ``ls --json`` keys),
    and the other names of its columns that ``query`` uses (``adv``, ...)."""
    con.register("trajectories", with_aliases(merged(table), query, leave=("spans",)))


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"\b{name}\b", text, re.IGNORECASE) is not None


def _connection_for(run: Any, text: str, selection: Selection | None) -> Any:
    """A connection holding the views ``text`` (one SQL statement) names, over ``run``."""
    if not text.strip():
        raise QueryError("empty SQL query")
    con = query_connection()
    try:
        statements = con.extract_statements(text)
    except duckdb_module().Error as exc:
        raise QueryError(f"sql: {one_line(exc)}") from None
    if len(statements) > 1:
        raise QueryError(f"sql: one statement at a time (got {len(statements)}); run each on its own")
    if statements and statements[0].type.name not in _READ_ONLY:  # a table it makes is its own
        con.close()
        con = connect()
    if _mentions(text, "trajectories"):
        register_trajectories(con, (selection or Selection()).trajectories(run), text)
    if _mentions(text, "spans"):
        register_spans(con, run)
    return con


def _checked(batch: pa.RecordBatch) -> pa.RecordBatch:
    try:
        batch.validate(full=True)  # text that is not UTF-8, offsets out of range: a damaged file
    except pa.ArrowInvalid as exc:
        raise QueryError(
            f"sql: the result holds values that are not valid ({one_line(exc)}); a span file may be damaged"
        ) from None
    return batch


def sql(run: Any, text: str, selection: Selection | None = None) -> pa.Table:
    """Run one SQL statement over the views ``trajectories`` and ``spans`` of ``run``; its rows
    (refused once they pass the memory limit: :func:`sql_rows` streams them instead)."""
    table = run_query(_connection_for(run, text, selection), text, "sql")
    for batch in table.to_batches():
        _checked(batch)
    return table


class Rows:
    """The rows of a query as DuckDB makes them, a batch at a time (:data:`STREAM_BATCH_ROWS` rows): at
    most a few batches are held at once, whatever the size of the result. DuckDB runs on a
    helper thread; Ctrl-C and the end of a :func:`~rlreplay.read.where.time_budget` stop it."""

    def __init__(self, con: Any, text: str, what: str) -> None:
        self._con, self._what = con, what
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        budget = current_budget()
        self._budget, self._deadline = budget, None if budget is None else time.monotonic() + budget
        self._thread = threading.Thread(
            target=self._produce, args=(text,), name="rlreplay-query", daemon=True
        )
        self._thread.start()
        kind, value = self._next()
        self.schema: pa.Schema = value if kind == "schema" else pa.schema([])
        if kind == "end":
            self.close()  # no rows to read

    def _put(self, item: tuple[str, Any]) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def _produce(self, text: str) -> None:
        try:
            relation = self._con.sql(text)
            if relation is None:  # a statement without rows
                return
            reader = relation.to_arrow_reader(STREAM_BATCH_ROWS)
            self._put(("schema", reader.schema))
            for batch in reader:
                if self._stop.is_set():
                    return
                self._put(("batch", batch))
        except BaseException as exc:  # handed to the reading thread
            self._put(("error", exc))
        finally:
            self._put(("end", None))

    def _next(self) -> tuple[str, Any]:
        try:
            while True:
                try:
                    kind, value = self._queue.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    if self._deadline is not None and time.monotonic() >= self._deadline:
                        self.close()
                        raise QueryError(
                            f"{self._what}: stopped after {self._budget:g} s, the time a query may take here"
                        ) from None
        except KeyboardInterrupt:
            self.close()
            raise
        if kind == "error":
            self.close()
            if isinstance(value, QueryError):
                raise QueryError(f"{self._what}: {value}") from None
            if isinstance(value, (duckdb_module().Error, pa.ArrowException, OSError)):
                raise QueryError(f"{self._what}: {one_line(value)}") from None
            raise value
        return kind, value

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        while not self._stop.is_set():
            kind, batch = self._next()
            if kind != "batch":
                self.close()
                return
            yield _checked(batch)

    def close(self) -> None:
        """Stop the query (rows not read yet are not made) and wait for DuckDB to let go: a thread
        still inside DuckDB as the interpreter exits aborts the process."""
        if not self._stop.is_set():
            self._stop.set()
            self._con.interrupt()
        self._thread.join(timeout=10.0)


def sql_rows(run: Any, text: str, selection: Selection | None = None) -> Rows:
    """:func:`sql`'s rows streamed, never all held: what ``rlreplay sql`` prints."""
    return Rows(_connection_for(run, text, selection), text, "sql")


_STATS_SQL = """
WITH t AS (
    SELECT *, coalesce(CAST(sample_index AS VARCHAR), 'id:' || id) AS _group FROM trajectories
),
g AS (
    SELECT step, validate, _group, count(reward) AS rewarded, min(reward) = max(reward) AS same
    FROM t GROUP BY step, validate, _group
),
gs AS (
    SELECT step, validate,
        avg(CASE WHEN same THEN 1.0 ELSE 0.0 END) FILTER (WHERE rewarded >= 2) AS frac_groups_zero_std
    FROM g GROUP BY step, validate
)
SELECT
    t.step,
    t.validate,
    count(*) AS trajectories,
    count(DISTINCT _group) AS groups,
    avg(reward) AS reward_mean,
    stddev_pop(reward) AS reward_std,
    avg(CASE WHEN reward > 0 THEN 1.0 WHEN reward IS NOT NULL THEN 0.0 END) AS frac_reward_positive,
    any_value(gs.frac_groups_zero_std) AS frac_groups_zero_std,
    avg(response_tokens) AS response_tokens_mean,
    quantile_cont(response_tokens, 0.95) AS response_tokens_p95,
    avg(model_calls) AS model_calls_mean,
    avg(tool_calls) AS tool_calls_mean,
    sum(tool_errors) / nullif(sum(tool_calls), 0) AS tool_error_rate,
    avg(CASE WHEN status = 'error' THEN 1.0 ELSE 0.0 END) AS error_rate,
    quantile_cont(duration_s, 0.5) AS duration_p50_s,
    quantile_cont(duration_s, 0.95) AS duration_p95_s,
    avg(advantage) AS advantage_mean,
    stddev_pop(advantage) AS advantage_std,
    avg(logprob_diff_mean) AS logprob_diff_mean,
    quantile_cont(logprob_diff_max, 0.95) AS logprob_diff_p95,
    quantile_cont(importance_ratio, 0.05) AS importance_ratio_p5,
    quantile_cont(importance_ratio, 0.95) AS importance_ratio_p95
FROM t LEFT JOIN gs
    ON t.step IS NOT DISTINCT FROM gs.step AND t.validate IS NOT DISTINCT FROM gs.validate
GROUP BY t.step, t.validate
ORDER BY TRY_CAST(t.step AS BIGINT) NULLS LAST, t.step NULLS LAST, t.validate NULLS LAST
"""


def stats(run: Any, selection: Selection | None = None) -> pa.Table:
    """One row per step and split (:data:`STATS_COLUMNS`) over the selected trajectories."""
    table = (selection or Selection()).trajectories(run)
    return stats_of(table)


def stats_of(table: pa.Table) -> pa.Table:
    """:func:`stats` over a listing already read."""
    con = shared_connection()
    register_trajectories(con, table)
    try:
        out = run_query(con, _STATS_SQL, "stats")
    finally:
        con.unregister("trajectories")
    return out.select(list(STATS_COLUMNS))


__all__ = [
    "STATS_COLUMNS",
    "Rows",
    "register_spans",
    "register_trajectories",
    "sql",
    "sql_rows",
    "stats",
    "stats_of",
]
