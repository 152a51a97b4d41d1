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
    memory_limit: MemoryLimitOption = None,
) -> None:
    """Query a run with SQL (DuckDB).

    Files cannot be read or written from the query; it uses at most --memory-limit of memory,
    and Ctrl-C stops it."""
    from rlreplay.read.query import sql

    run_path, query = (Path(first), second) if second is not None else (None, first)
    if query is None:
        fail('give the query: rlreplay sql [RUN] "SELECT ..."')
    set_memory_limit(memory_limit)
    opened = open_run_arg(run, run_path)
    table = sql(opened, query)
    report_warnings(opened)
    rows = table.to_pylist()
    if as_json:
        write = sys.stdout.write
        for row in rows:
            write(orjson.dumps(row, default=_json_default, option=orjson.OPT_NON_STR_KEYS).decode() + "\n")
        return
    names = table.column_names
    cells = [[_cell(row[n]) for n in names] for row in rows]
    widths = [min(60, max([len(n), *(len(r[i]) for r in cells)])) for i, n in enumerate(names)]

    def clip(text: str, width: int) -> str:
        return text if len(text) <= width else text[: width - 1] + "…"

    out = ["  ".join(clip(n, w).ljust(w) for n, w in zip(names, widths)).rstrip()]
    out += ["  ".join(clip(c, w).ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    sys.stdout.write("\n".join(out) + f"\n({len(rows)} rows)\n")
