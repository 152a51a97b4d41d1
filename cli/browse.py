"""Browsing a run: ``ls``, ``show``, ``info``, ``recover``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer

from rlreplay.cli.app import (
    SIGNAL_COLUMNS,
    EngineOption,
    FindingOption,
    JsonOption,
    RayAddressOption,
    RunArgument,
    RunOption,
    TokenizerOption,
    app,
    cluster_for,
    console,
    fail,
    fit_columns,
    flagged,
    key_fields,
    open_run_arg,
    plural,
    report_warnings,
    selection_options,
    shown,
    signal_cell,
    terminal_width,
    trajectories,
)

if TYPE_CHECKING:
    from rich.table import Table
    from rich.tree import Tree

PREVIEW_CHARS = 160
PREVIEW_IDS = 8


#: Longer listings, and any listing not going to a terminal, are printed as plain columns.
RICH_ROWS = 200


@dataclass(frozen=True)
class LsColumn:
    """One column of ``ls``: the listing field it shows (its header), alignment, and how."""

    name: str
    right: bool
    cell: Callable[[Any], str]
    signal: bool = False  # shown only when the run has a value in it


def _text(value: Any) -> str:
    return "" if value is None else str(value)


#: In order of priority: a narrow terminal keeps the first ones.
LS_COLUMNS = (
    LsColumn("id", False, lambda v: v[:12]),
    LsColumn("step", True, _text),
    LsColumn("sample_index", True, _text),
    LsColumn("rollout_n", True, _text),
    LsColumn("validate", False, lambda v: "val" if v else "train"),
    LsColumn("reward", True, lambda v: "" if v is None else f"{v:g}"),
    *(LsColumn(name, True, signal_cell, signal=True) for name in SIGNAL_COLUMNS),
    LsColumn("status", False, _text),
    LsColumn("model_calls", True, _text),
    LsColumn("tool_calls", True, _text),
    LsColumn("duration_s", True, lambda v: f"{v:.2f}s"),
    LsColumn("num_spans", True, _text),
    LsColumn("agent", False, _text),
    LsColumn("worker", False, _text),
)
_BY_NAME = {c.name: c for c in LS_COLUMNS}


def ls_columns(text: str | None) -> list[LsColumn] | None:
    """The columns ``--columns`` names (None: the default choice), by the listing's names or their
    aliases (``adv``); bad names exit 2."""
    from rlreplay.format.keys import column_name

    if text is None:
        return None
    names = [column_name(n.strip()) for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown or not names:
        fail(
            f"--columns: unknown column {', '.join(map(repr, unknown)) or '(none given)'} "
            f"(columns: {', '.join(_BY_NAME)})"
        )
    return [_BY_NAME[n] for n in names]


def _listing_cells(table: Any, chosen: list[LsColumn] | None) -> tuple[list[list[str]], list[LsColumn]]:
    """The ls columns as strings, column by column, and the columns they are."""
    from rlreplay.format.index import merged

    values = merged(table).to_pydict()
    if chosen is None:
        chosen = [c for c in LS_COLUMNS if not c.signal or any(v is not None for v in values[c.name])]
    cells = []
    for column in chosen:
        if column.name == "agent":
            cells.append([a or n or "" for a, n in zip(values["agent"], values["name"])])
        else:
            cells.append([column.cell(v) for v in values[column.name]])
    return cells, chosen


def _fit(
    cells: list[list[str]], columns: list[LsColumn], width: int
) -> tuple[list[list[str]], list[LsColumn]]:
    """The first columns whose widths (two spaces apart) fit ``width`` characters."""
    kept = fit_columns([max([len(c.name), *map(len, col)]) for c, col in zip(columns, cells)], width)
    return cells[:kept], columns[:kept]


def _plain_listing(cells: list[list[str]], columns: list[LsColumn]) -> str:
    widths = [max([len(c.name), *map(len, col)]) for c, col in zip(columns, cells)]
    lines = ["  ".join(c.name.rjust(w) if c.right else c.name.ljust(w) for c, w in zip(columns, widths))]
    for row in zip(*cells):
        lines.append(
            "  ".join(v.rjust(w) if c.right else v.ljust(w) for v, c, w in zip(row, columns, widths))
        )
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _rich_listing(cells: list[list[str]], columns: list[LsColumn]) -> Table:
    from rich.table import Table
    from rich.text import Text

    grid = Table(box=None, header_style="bold", pad_edge=False)
    for column in columns:
        grid.add_column(column.name, justify="right" if column.right else "left", no_wrap=True)
    for row in zip(*cells):
        grid.add_row(*(Text(c) for c in row))
    return grid


@app.command("ls")
@selection_options
def ls_command(
    run_path: RunArgument = None,
    run: RunOption = None,
    as_json: JsonOption = False,
    columns: Annotated[
        str | None,
        typer.Option(
            "--columns",
            metavar="NAMES",
            help="Comma-separated columns to show (default: those that fit the terminal, keys and "
            f"signals first). Columns: {', '.join(c.name for c in LS_COLUMNS)}.",
        ),
    ] = None,
    finding: FindingOption = None,
    tokenizer: TokenizerOption = None,
    engine_name: EngineOption = "local",
    ray_address: RayAddressOption = None,
    *,
    selection: Any,
) -> None:
    """List trajectories, one row each.

    With --json, one JSON object per line; --grep searches their decoded text (--engine ray: on
    a Ray cluster)."""
    chosen = ls_columns(columns)
    cluster = cluster_for(engine_name, ray_address)  # asked for and not there: said, even without --grep
    opened = open_run_arg(run, run_path)
    keep = None if finding is None else lambda table: flagged(opened, table, finding)
    texts = None
    if selection.grep is not None and cluster is not None:
        from rlreplay.engine import Search

        texts = Search(opened, tokenizer, cluster)
    elif selection.grep is not None:
        from rlreplay.read.search import TextSearch

        texts = TextSearch.for_run(opened, tokenizer)
    table = selection.trajectories(opened, keep=keep, texts=texts)
    report_warnings(opened)
    if as_json:
        from rlreplay.model import listing_json

        extra = None
        if opened.manifest.get("replay"):  # a replay's rows say what each trajectory was served from
            from rlreplay.read.replays import COLUMNS, replay_rows

            replayed = replay_rows(opened, selection.filters())
            served = [replayed.get(i, {}) for i in table["id"].to_pylist()]
            extra = {k: [r.get(k) for r in served] for k in COLUMNS}
        # slices made on up to 4 threads (each slice made ahead holds its text: memory stays small)
        for text in listing_json(table, extra, chunk=32768, threads=min(os.cpu_count() or 1, 4)):
            sys.stdout.write(text)
        return
    shown = table.num_rows
    total = trajectories(shown) + ("" if selection.limit is None else " (--limit)")
    if shown == 0:
        sys.stderr.write(f"no trajectories selected in {opened.address}\n")
        return
    cells, names = _listing_cells(table, chosen)
    width = terminal_width()
    if columns is None and width is not None:
        cells, names = _fit(cells, names, width)
    if sys.stdout.isatty() and shown <= RICH_ROWS:
        out = console()
        out.print(_rich_listing(cells, names))
        out.print(f"{total} in {opened.address}", markup=False)
    else:
        sys.stdout.write(_plain_listing(cells, names))
        sys.stdout.write(f"{total} in {opened.address}\n")
    counters = opened.counters()
    losses = {k: v for k, v in counters.items() if k != "spans" and v}
    if losses:
        console().print(
            "recording losses: " + ", ".join(f"{k}={v}" for k, v in losses.items()), style="yellow"
        )


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def preview(value: Any, limit: int = PREVIEW_CHARS) -> str:
    """A short view of a decoded payload value: long id lists and strings are shortened; strings
    are shown as their text (no quotes, no escapes)."""
    if (
        isinstance(value, list)
        and len(value) > PREVIEW_IDS
        and all(isinstance(v, int) for v in value[:PREVIEW_IDS])
    ):
        head = " ".join(str(v) for v in value[:PREVIEW_IDS])
        return f"[{head} …] ({len(value):,} ids)"
    if isinstance(value, dict) and value.get("__type__") == "bytes":  # kept bytes: UTF-8 as text
        from rlreplay.format.payload import kept_text

        text = kept_text(value, limit)
        if text is not None:
            return text
    if isinstance(value, str):  # text as text: its line breaks are line breaks
        return value if len(value) <= limit else value[:limit] + "…"
    text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    return text if len(text) <= limit else text[:limit] + "…"


def _payload_lines(label: str, value: Any, top: bool = True) -> list[str]:
    """One line per field; lists and dicts holding multi-line text are opened up so that their
    text shows as text, not as JSON with escaped line breaks."""
    if value is None and top:
        return []
    if isinstance(value, dict) and value.get("__type__") == "exception":
        return [f"exception: {value.get('type')}: {value.get('message')}"]
    if isinstance(value, dict) and "__type__" not in value and (top or _multiline(value)):
        return [line for k, v in value.items() for line in _payload_lines(f"{label}.{k}", v, False)]
    if isinstance(value, (list, tuple)) and _multiline(value):
        return [line for i, v in enumerate(value) for line in _payload_lines(f"{label}[{i}]", v, False)]
    return [f"{label}: {preview(value)}"]


def _multiline(value: Any, depth: int = 0) -> bool:
    if isinstance(value, str):
        return "\n" in value
    if depth > 4:
        return False
    if isinstance(value, dict):
        return any(_multiline(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_multiline(v, depth + 1) for v in value[:64])
    return False


def span_label(span: Any, stopped: str | None = None) -> str:
    """A span's line in the tree; ``stopped``: how a model call stopped on its length limit."""
    from rich.markup import escape

    ms = (span.end_ns - span.start_ns) / 1e6
    parts = [f"[bold]{escape(span.name)}[/bold]", f"[dim]{span.kind}[/dim]", f"{ms:,.1f} ms"]
    if span.status != "ok":
        parts.append(f"[red]{escape(span.error or span.status)}[/red]")
    if stopped:
        parts.append(f"[yellow]truncated: {escape(stopped)}[/yellow]")
    if span.reward is not None:
        parts.append(f"reward={span.reward:g}")
    return "  ".join(parts)


def render_tree(traj: Any, text_lines: Any = None, stopped: dict[str, str] | None = None) -> Tree:
    """The span tree of a trajectory; ``text_lines(span)`` may add decoded text under a span;
    ``stopped``: the model calls that stopped on their length limit (span id -> how)."""
    from rich.markup import escape
    from rich.text import Text
    from rich.tree import Tree

    when = datetime.fromtimestamp(traj.start_ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")
    split = "validate" if traj.validate else "train"
    reward = "" if traj.reward is None else f"  reward={traj.reward:g}"
    for name in SIGNAL_COLUMNS:
        value = traj.row.get(name)
        reward += "" if value is None else f"  {name}={value:.4g}"
    title = (
        f"[bold]{traj.id}[/bold]  {key_fields(traj)} {split}  experiment={escape(shown(traj.experiment))} "
        f"worker={escape(traj.worker)}  {when}\n"
        f"status={traj.status}{reward}  model_calls={traj.model_calls} tool_calls={traj.tool_calls} "
        f"tool_errors={traj.tool_errors}" + _replay_line(traj.attributes)
    )
    tree = Tree(title)

    def add(node: Tree, span: Any) -> None:
        branch = node.add(span_label(span, (stopped or {}).get(span.span_id)))
        extra = text_lines(span) if text_lines is not None else None
        for line in extra or [*_payload_lines("in", span.inputs), *_payload_lines("out", span.output)]:
            branch.add(Text(line, style="dim")) if isinstance(line, str) else branch.add(line)
        for child in span.children:
            add(branch, child)

    for root in traj.roots:
        add(tree, root)
    return tree


def _replay_line(attributes: dict[str, Any]) -> str:
    """The header line of a replayed trajectory: served, diverged (and why) or live, and its source."""
    from rich.markup import escape

    from rlreplay.recorder.replay import REASON_KEY, SOURCE_KEY, STATUS_KEY

    status = attributes.get(STATUS_KEY)
    if status is None:
        return ""
    line = f"\nreplay={escape(str(status))}"
    if attributes.get(SOURCE_KEY):
        line += f" of {escape(str(attributes[SOURCE_KEY]))}"
    if attributes.get(REASON_KEY):
        line += f": {escape(str(attributes[REASON_KEY]))}"
    return line


def is_run_dir(text: str) -> bool:
    """Whether ``text`` names a run directory (it holds run.json or spans/)."""
    from rlreplay.format.manifest import MANIFEST
    from rlreplay.shards.layout import SPANS_DIR

    path = Path(text)
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / SPANS_DIR).is_dir())


@app.command("show")
def show_command(
    first: Annotated[
        str,
        typer.Argument(
            metavar="RUN|TRAJECTORY",
            help="The run directory (then TRAJECTORY follows), or the trajectory: an id (or unique "
            "prefix) or a selector such as step=5,sample_index=12,rollout_n=0.",
        ),
    ],
    second: Annotated[
        str | None,
        typer.Argument(
            metavar="TRAJECTORY", help="The trajectory, when the run comes first.", show_default=False
        ),
    ] = None,
    run: RunOption = None,
    text: Annotated[
        bool | None,
        typer.Option(
            "--text/--no-text",
            help="Decode token ids to text (default: when the run's tokenizer or --tokenizer loads).",
        ),
    ] = None,
    tokenizer: TokenizerOption = None,
    skip_special_tokens: Annotated[
        bool,
        typer.Option(
            "--skip-special-tokens/--keep-special-tokens",
            help="Leave special tokens such as <|im_start|> out of decoded text (default: keep them).",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Show one trajectory: span tree, timings and text.

    The span tree with timings, inputs and outputs, and the conversation as text."""
    from rlreplay.diff import pick

    run_path, ref = (Path(first), second) if second is not None else (None, first)
    if second is None and is_run_dir(first):
        fail(f"give a trajectory after the run: rlreplay show {first} ID_OR_SELECTOR")
    if second is not None and run is not None and not is_run_dir(first) and not Path(first).exists():
        fail(f"two trajectories given ({first} and {second}): show shows one; rlreplay diff compares two")
    from rlreplay.adapters.registry import adapter_for_run

    opened = open_run_arg(run, run_path)
    traj = opened.trajectory(pick.resolve(opened, pick.parse_selector(ref)))
    report_warnings(opened)
    adapter = adapter_for_run(opened)
    decoder = _show_decoder(opened, text, tokenizer)
    if decoder is not None:
        from rlreplay.text.token2text import add_text

        add_text([traj], decoder, skip_special_tokens=skip_special_tokens, adapter=adapter)
    if as_json:
        typer.echo(
            orjson.dumps(traj.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
        )
        return
    from rlreplay.audit.calls import length_stops

    stopped = length_stops(traj, adapter)
    out = console()
    if decoder is None:
        out.print(render_tree(traj, stopped=stopped), markup=True)
        return
    out.print(render_tree(traj, text_lines=_show_text_lines, stopped=stopped), markup=True)
    for renderable in _show_conversation(traj, adapter, stopped):
        out.print(renderable)


def _show_decoder(opened: Any, text: bool | None, tokenizer: str | None) -> Any:
    """The decoder ``show`` uses, or None. Asked for explicitly and unavailable: an error (exit 2);
    named only by the manifest and unavailable: a warning, and token ids are shown."""
    import sys

    from rlreplay.text.token2text import Decoder, TokenizerUnavailable, resolve_tokenizer

    if text is False:
        return None
    name = resolve_tokenizer(opened, tokenizer)
    if name is None:
        if text:
            fail("no tokenizer is known for this run; pass --tokenizer /path/to/dir-with-tokenizer.json")
        return None
    try:
        return Decoder.load(name)
    except TokenizerUnavailable as exc:
        if text or tokenizer is not None:
            raise
        print(f"rlreplay: warning: {exc} (showing token ids)", file=sys.stderr)
        return None


_SHOW_DECODED = {"prompt_ids": "prompt_text", "token_ids": "response_text", "output_ids": "response_text"}
_SHOW_DECODED_AGENT = {**_SHOW_DECODED, "response_ids": "response_text"}


def _show_text_lines(span: Any) -> list[Any]:
    """Payload lines with decoded text in place of the token ids it came from (as rich Text:
    decoded text is full of brackets that must not be read as markup)."""
    from rich.text import Text

    lines: list[str] = []
    for label, value in (("in", span.inputs), ("out", span.output)):
        if isinstance(value, dict) and "__type__" not in value:
            decoded = _SHOW_DECODED_AGENT if span.kind == "agent" else _SHOW_DECODED
            value = {
                k: v
                for k, v in value.items()
                if k != "conversation" and not (k in decoded and decoded[k] in value)
            }
            prompt = value.get("prompt_text")
            if span.kind == "llm" and isinstance(prompt, str) and len(prompt) > PREVIEW_CHARS:
                # a model call's prompt is the whole context so far: its end is what is new
                value["prompt_text"] = "…" + prompt[-(PREVIEW_CHARS - 1) :]
        lines.extend(_payload_lines(label, value))
    return [Text(line, style="dim") for line in lines]


def _show_conversation(traj: Any, adapter: Any, stopped: dict[str, str]) -> list[Any]:
    """The conversation of the trajectory's agent span: a header per turn (an answer cut by its
    length limit says so), its text, its tool calls."""
    from rich.rule import Rule
    from rich.text import Text

    from rlreplay.text.conversation import turns as conversation_turns

    turns = next(
        (
            s.output["conversation"]
            for s in traj.spans
            if isinstance(s.output, dict) and isinstance(s.output.get("conversation"), list)
        ),
        None,
    )
    if not turns:
        return []
    styles = {"prompt": "bold blue", "assistant": "bold green", "tool": "bold yellow"}
    counts = f"{plural(traj.model_calls, 'model call')}, {plural(traj.tool_calls, 'tool call')}"
    items: list[Any] = [Rule(f"conversation ({counts})", style="dim")]
    span_ids = [t.span_id for t in conversation_turns(traj, adapter=adapter)]  # the turns add_text decoded
    for i, turn in enumerate(turns):
        role = str(turn.get("role"))
        head = Text(f"[{i}] {role}", style=styles.get(role, "bold"))
        how = stopped.get(span_ids[i]) if i < len(span_ids) and span_ids[i] else None
        if how:
            head.append(f"  truncated: {how}", style="bold yellow")
        items.append(head)
        items.append(Text(turn.get("text") or ""))
        for call in turn.get("tool_calls") or []:
            args = orjson.dumps(call.get("arguments"), option=orjson.OPT_NON_STR_KEYS).decode()
            items.append(Text(f"  → tool call {call.get('name')}({args})", style="cyan"))
    return items


@app.command("info")
def info_command(
    run_path: Annotated[Path | None, typer.Argument(metavar="RUN", help="Run directory.")] = None,
    run: RunOption = None,
    as_json: JsonOption = False,
) -> None:
    """Summarize a run.

    Manifest, steps, trajectories, spans and bytes on disk now, and what the
    recording processes reported (spans written, dropped, spilled, lost)."""
    from rlreplay.read.summary import RECORDER_KEYS, run_summary

    opened = open_run_arg(run, run_path)
    summary = run_summary(opened)
    report_warnings(opened)
    if as_json:
        typer.echo(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
        return
    out = console()
    for key, value in summary.items():
        if key == RECORDER_KEYS[0]:
            out.print(f"{'recorder':>18}: (counters the recording processes reported)", markup=False)
        out.print(f"{key:>18}: {shown(value)}", markup=False)


@app.command("recover")
def recover_command(
    run_path: Annotated[Path | None, typer.Argument(metavar="RUN", help="Run directory.")] = None,
    run: RunOption = None,
    spool: Annotated[
        Path | None,
        typer.Option("--spool", metavar="DIR", help="Spool folder of a URI run (default: $RLREPLAY_SPOOL)."),
    ] = None,
) -> None:
    """Seal the live files a killed recorder left behind.

    Only once its processes are gone."""
    from rlreplay import errors
    from rlreplay.read.summary import recover
    from rlreplay.remote import location, publish

    if uri := location.as_uri(run_path) or location.as_uri(run):  # push what this node's spool holds
        try:
            totals = publish.recover(uri, spool)
        except errors.StorageError as exc:
            fail(str(exc))
        console().print(publish.recover_message(uri, totals), markup=False)
        return
    opened = open_run_arg(run, run_path)
    results = recover(opened.path)
    out = console()
    for line in results["files"]:
        out.print(line, markup=False)
    out.print(
        f"recovered {plural(results['recovered_shards'], 'shard')} "
        f"({plural(results['recovered_spans'], 'span')}); "
        f"set aside {plural(results['quarantined_files'], 'file')} "
        f"({plural(format(results['discarded_bytes'], ','), 'unreadable byte')})"
        + (f" in {opened.path / '_quarantine'}" if results["quarantined_files"] else "")
        + (
            f"; left alone {plural(results['live_partials'], 'file')} still being written"
            if results["live_partials"]
            else ""
        ),
        markup=False,
    )
