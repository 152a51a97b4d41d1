"""``rlreplay sql``: any SQL (DuckDB) over the views ``trajectories`` and ``spans`` of a run."""

from __future__ import annotations

import sys
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from rlreplay.cli.app import (
    JsonOption,
    MemoryLimitOption,
    RunOption,
    app,
    fail,
    open_run_arg,
    plural,
    report_warnings,
    set_memory_limit,
)


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    return str(value)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return orjson.dumps(value, default=_json_default).decode()
    return " ".join(str(value).split()) if isinstance(value, str) else str(value)


#: Rows the table shows unless --limit says otherwise (--json prints every row).
SHOWN_ROWS = 1000
#: Of a list or a text too long for its column, the part that is read for the table.
_PREVIEW_ITEMS, _PREVIEW_BYTES = 64, 1024


def _preview(scalar: Any) -> str:
    """A table cell of an Arrow value, reading only its beginning when it is a long list or text."""
    import pyarrow as pa

    kind = scalar.type
    if scalar.is_valid and (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        items = scalar.values
        if len(items) > _PREVIEW_ITEMS:
            return _cell(items.slice(0, _PREVIEW_ITEMS).to_pylist())[:-1] + ",…]"
    if scalar.is_valid and (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        data = scalar.as_buffer()
        if data.size > _PREVIEW_BYTES:
            return _cell(data[:_PREVIEW_BYTES].to_pybytes().decode("utf-8", "ignore")) + "…"
    return _cell(scalar.as_py())


@app.command("sql")
def sql_command(
    first: Annotated[
        str | None,
        typer.Argument(metavar="RUN", help="Run directory (optional; else --run or the default run)."),
    ] = None,
    second: Annotated[
        str | None,
        typer.Argument(
            metavar="QUERY",
            help="SQL over the views trajectories (the ls --json columns) and spans (span rows, "
            "payloads as JSON text).",
        ),
    ] = None,
    run: RunOption = None,
    as_json: JsonOption = False,
    limit: Annotated[
        int,
        typer.Option(
            "--limit",
            metavar="N",
            min=1,
            help=f"Rows the table shows (default {SHOWN_ROWS}); --json prints every row.",
        ),
    ] = SHOWN_ROWS,
    memory_limit: MemoryLimitOption = None,
) -> None:
    """Query a run with SQL (DuckDB).

    Files cannot be read or written from the query; it uses at most --memory-limit of memory,
    and Ctrl-C stops it. Rows are printed as they come, never all held: the table shows the
    first --limit rows and says when there are more; --json prints every row."""
    from rlreplay.read.query import sql_rows

    run_path, query = (Path(first), second) if second is not None else (None, first)
    if query is None:
        fail('give the query: rlreplay sql [RUN] "SELECT ..."')
    set_memory_limit(memory_limit)
    opened = open_run_arg(run, run_path)
    rows = sql_rows(opened, query)
    try:
        report_warnings(opened)
        _print(rows, as_json, limit)
    finally:
        rows.close()  # a reader gone (head), an error: DuckDB stops before the process ends


def _print(rows: Any, as_json: bool, limit: int) -> None:
    """The rows as JSON lines, or the table of the first ``limit`` and a line saying how many."""
    if as_json:
        write = sys.stdout.write
        for batch in rows:
            for row in batch.to_pylist():
                write(
                    orjson.dumps(row, default=_json_default, option=orjson.OPT_NON_STR_KEYS).decode() + "\n"
                )
        return
    names = rows.schema.names
    cells: list[list[str]] = []
    more = False
    for batch in rows:
        if len(cells) + batch.num_rows > limit:
            batch, more = batch.slice(0, limit - len(cells)), True
        columns = batch.columns
        cells += [[_preview(column[i]) for column in columns] for i in range(batch.num_rows)]
        if more:
            rows.close()  # the rest is not made
            break
    widths = [min(60, max([len(n), *(len(r[i]) for r in cells)])) for i, n in enumerate(names)]

    def clip(text: str, width: int) -> str:
        return text if len(text) <= width else text[: width - 1] + "…"

    out = ["  ".join(clip(n, w).ljust(w) for n, w in zip(names, widths)).rstrip()]
    out += ["  ".join(clip(c, w).ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    shown = f"(first {plural(len(cells), 'row')} shown; more follow: --limit N, or --json for every row)"
    sys.stdout.write("\n".join(out) + "\n" + (shown if more else f"({plural(len(cells), 'row')})") + "\n")
