"""``rlreplay diff``: where two trajectories part ways, turn by turn."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer

from rlreplay.cli.app import (
    NO_TEXT,
    SIGNAL_COLUMNS,
    JsonOption,
    NoTextWas,
    RunOption,
    TokenizerOption,
    app,
    console,
    elide,
    fail,
    fit_columns,
    key_fields,
    open_run_arg,
    plural,
    selection_options,
    shown,
    signal_cell,
    terminal_width,
)
from rlreplay.format.keys import SELECT_KEYS

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table
    from rich.text import Text

DEL_OPEN, DEL_CLOSE = "[-", "-]"
INS_OPEN, INS_CLOSE = "{+", "+}"
DEL_STYLE = "bold red"
INS_STYLE = "bold green"
CONTEXT_WORDS = 12
CONTEXT_TOKENS = 8
MAX_CHANGE_CHARS = 2000
ROLE_NAMES = {"prompt": "prompt", "assistant": "assistant", "tool": "tool"}
STATUS_MARK = {"equal": "=", "changed": "~", "only_a": "-", "only_b": "+"}


# ---- pieces ------------------------------------------------------------------------------------


def _side_label(side: Any, run_shown: bool) -> str:
    split = "validate" if side.validate else "train"
    where = f"  run={side.run}" if run_shown and side.run else ""
    return f"{side.id[:12]}  {key_fields(side)} {split}  experiment={shown(side.experiment)}{where}"


def _num(value: Any, seconds: bool = False, signed: bool = False) -> str:
    if value is None:
        return "–"
    if seconds:
        return f"{value:+.2f}s" if signed else f"{value:.2f}s"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:+.4g}" if signed else f"{value:.4g}"
    if isinstance(value, float):
        value = int(value)
    return f"{value:+,}" if signed else f"{value:,}"


#: (label, Side field, seconds): the labels are the --json names, as in ``ls`` and ``show``.
SUMMARY_ROWS = [
    ("reward", "reward", False),
    ("status", "status", False),
    ("model_calls", "model_calls", False),
    ("tool_calls", "tool_calls", False),
    ("tool_errors", "tool_errors", False),
    ("prompt_tokens", "prompt_tokens", False),
    ("response_tokens", "response_tokens", False),
    ("model_tokens", "model_tokens", False),
    ("duration_s", "duration_s", True),
    ("llm_s", "llm_s", True),
    ("tool_s", "tool_s", True),
]


def columns(header: list[str], rows: list[list[str]], right: set[int]) -> Text:
    """Aligned plain-text columns (a bold header line), cheap to print however long."""
    from rich.text import Text

    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    text = Text(line(header), style="bold")
    for row in rows:
        text.append("\n" + line(row))
    return text


def summary_table(diff: Any) -> Text:
    deltas = diff.deltas
    rows = []
    for label, name, seconds in SUMMARY_ROWS:
        va, vb = getattr(diff.a, name), getattr(diff.b, name)
        if name == "status":
            rows.append([label, str(va), str(vb), "" if va == vb else "changed"])
            continue
        delta = deltas.get(name)
        shown = "" if delta in (None, 0) else _num(delta, seconds, signed=True)
        rows.append([label, _num(va, seconds), _num(vb, seconds), shown])
    return columns(["", "A", "B", "B−A"], rows, right={1, 2, 3})


def divergence_line(diff: Any) -> Text:
    from rich.text import Text

    div = diff.first_divergence
    if div is None:
        return Text("token ids identical (prompt and response)", style="bold")
    if div.response_offset is None:
        where = f"the prompt, token {div.token_offset}"
    else:
        roles = {t.index_a: t.role for t in diff.turns if t.index_a is not None}
        if div.ended == "a":
            roles = {t.index_b: t.role for t in diff.turns if t.index_b is not None}
        role = roles.get(div.turn, "")
        where = f"turn {div.turn} ({role}), token {div.token_offset} of the turn"
        where += f", response token {div.response_offset}"
        if div.turn_b is not None and div.turn_b != div.turn:
            where += f" (turn {div.turn_b} in B)"
    ended = {"a": "; A ends there", "b": "; B ends there"}.get(div.ended or "", "")
    return Text(f"first divergence: {where}{ended}", style="bold")


def _fmt_items(value: Any, unit: str) -> str:
    return value if unit == "words" else " ".join(map(str, value))


def _trim_equal(value: Any, unit: str, head: bool, tail: bool, full: bool) -> str:
    """Context around changes: an equal run keeps its start when a change comes before it
    (``head``) and its end when one follows (``tail``); the middle is elided with a count."""
    from rlreplay.diff.align import split_words

    if full:
        return _fmt_items(value, unit)
    words = unit == "words"
    items = split_words(value) if words else list(value)
    keep = CONTEXT_WORDS * 2 if words else CONTEXT_TOKENS  # words come with their spaces
    kept = keep * (int(head) + int(tail))
    if len(items) <= kept + 2:
        return _fmt_items(value, unit)
    start = keep if head else 0
    stop = len(items) - keep if tail else len(items)
    elided = items[start:stop]
    if words:
        count = sum(1 for w in elided if not w.isspace())
        return f"{''.join(items[:start])}…({plural(count, 'word')})…{''.join(items[stop:])}"
    left, right = " ".join(map(str, items[:start])), " ".join(map(str, items[stop:]))
    return f"{left} …({plural(len(elided), 'token')})… {right}".strip()


def _trim_change(value: str, full: bool) -> str:
    if full or len(value) <= MAX_CHANGE_CHARS:
        return value
    half = MAX_CHANGE_CHARS // 2
    return f"{value[:half]}…({len(value) - 2 * half} chars)…{value[-half:]}"


def _joiner(unit: str) -> str:
    return "" if unit == "words" else " "


def inline_diff(segments: list[Any], unit: str, full: bool = False) -> Text:
    """One text with deletions as ``[-old-]`` and insertions as ``{+new+}``."""
    from rich.text import Text

    out = Text()
    sep = _joiner(unit)
    for i, seg in enumerate(segments):
        if out and sep:
            out.append(sep)
        if seg.op == "equal":
            out.append(_trim_equal(seg.a, unit, head=i > 0, tail=i < len(segments) - 1, full=full))
            continue
        old, new = _fmt_items(seg.a, unit), _fmt_items(seg.b, unit)
        if old:
            out.append(DEL_OPEN + _trim_change(old, full) + DEL_CLOSE, style=DEL_STYLE)
        if new:
            if old and sep:
                out.append(sep)
            out.append(INS_OPEN + _trim_change(new, full) + INS_CLOSE, style=INS_STYLE)
    return out


def side_by_side(segments: list[Any], unit: str, full: bool = False) -> Table:
    """Two columns: A with its deletions marked, B with its insertions marked."""
    from rich.table import Table
    from rich.text import Text

    left, right = Text(), Text()
    sep = _joiner(unit)
    for i, seg in enumerate(segments):
        if seg.op == "equal":
            context = _trim_equal(seg.a, unit, head=i > 0, tail=i < len(segments) - 1, full=full)
            for col in (left, right):
                if col and sep:
                    col.append(sep)
                col.append(context)
            continue
        for col, value, (opener, closer, style) in (
            (left, seg.a, (DEL_OPEN, DEL_CLOSE, DEL_STYLE)),
            (right, seg.b, (INS_OPEN, INS_CLOSE, INS_STYLE)),
        ):
            shown = _fmt_items(value, unit)
            if shown:
                if col and sep:
                    col.append(sep)
                col.append(opener + _trim_change(shown, full) + closer, style=style)
    grid = Table(box=None, show_header=True, header_style="bold", expand=True, pad_edge=False)
    grid.add_column("A", ratio=1)
    grid.add_column("B", ratio=1)
    grid.add_row(left, right)
    return grid


def _index(i: int | None) -> str:
    return "–" if i is None else str(i)


def _tokens(turn: Any) -> str:
    return plural(format(len(turn.token_ids), ","), "token")


def turn_header(t: Any) -> Text:
    from rich.text import Text

    idx = _index(t.index_a) if t.index_a == t.index_b else f"{_index(t.index_a)}→{_index(t.index_b)}"
    head = Text(f"{STATUS_MARK[t.status]} turn {idx} {ROLE_NAMES.get(t.role, t.role)}: ", style="bold")
    ta, tb = t.turn_a, t.turn_b
    if t.status == "equal":
        head.append(f"equal ({_tokens(ta)})")
    elif t.status == "changed":
        sizes = f"A {_tokens(ta)}, B {_tokens(tb)}"
        head.append(f"changed at token {t.first_diff} ({sizes})")
        if t.same_text:
            head.append("; same text, different token ids")
    elif t.status == "only_a":
        head.append(f"only in A ({_tokens(ta)})")
    else:
        head.append(f"only in B ({_tokens(tb)})")
    if t.duration_a_s is not None or t.duration_b_s is not None:
        head.append(f"  [{_num(t.duration_a_s, True)} vs {_num(t.duration_b_s, True)}]", style="dim")
    return head


def _tool_cell(info: dict[str, Any] | None) -> str:
    if info is None:
        return "–"
    params = orjson.dumps(info["parameters"], option=orjson.OPT_NON_STR_KEYS).decode()
    text = f"{info['name']}({params}) {info['status']} {info['duration_s']:.3f}s"
    return text + (f": {info['error']}" if info["error"] else "")


def tools_table(diff: Any) -> Text | None:
    """Tool calls in call order: one line when equal, an A line and a B line when not."""
    from rich.text import Text

    if not diff.tools:
        return None
    out = Text()
    for t in diff.tools:
        if out:
            out.append("\n")
        mark = f"{STATUS_MARK[t.status]} #{t.index}  "
        if t.status == "equal":
            out.append(f"{mark}{_tool_cell(t.a)} / {t.b['duration_s']:.3f}s")
            continue
        out.append(f"{mark}A: ")
        out.append(_tool_cell(t.a), style=DEL_STYLE if t.a else None)
        out.append("\n" + " " * len(mark) + "B: ")
        out.append(_tool_cell(t.b), style=INS_STYLE if t.b else None)
    return out


def render_diff(
    diff: Any, layout: str = "unified", full: bool = False, wrap: bool = False
) -> list[RenderableType]:
    """Everything ``rlreplay diff`` prints, as rich renderables; ``wrap``: tool call lines wrapped
    to the console's width (a terminal's), else whole."""
    from rich.console import Group
    from rich.text import Text

    two_runs = diff.a.run != diff.b.run
    parts: list[RenderableType] = [
        Text(f"A  {_side_label(diff.a, two_runs)}"),
        Text(f"B  {_side_label(diff.b, two_runs)}"),
        Text(""),
        divergence_line(diff),
    ]
    if diff.identical:
        parts.append(Text("no differences", style="bold"))
    parts += [Text(""), summary_table(diff), Text("")]
    counts = diff.counts()
    parts.append(
        Text(
            f"conversation: {counts['equal']} equal, {counts['changed']} changed, "
            f"{counts['only_a']} only in A, {counts['only_b']} only in B"
            + ("" if diff.text else "  (compared as token ids)"),
            style="bold",
        )
    )
    for t in diff.turns:
        parts.append(turn_header(t))
        if t.status != "equal" or full:
            segments = t.segments
            if t.status == "equal":  # --full: show equal turns too
                from rlreplay.diff.align import Segment

                value = t.turn_a.text if diff.text else t.turn_a.token_ids
                segments = [Segment("equal", value, value)]
            body = (
                side_by_side(segments, t.unit, full)
                if layout == "side"
                else inline_diff(segments, t.unit, full)
            )
            parts.append(Group(body) if layout == "side" else _indent(body))
        if t.role == "assistant" and t.tool_calls_changed:
            from rlreplay.diff.align import format_tool_calls

            calls = Text("    tool calls: ")
            calls.append(
                DEL_OPEN + format_tool_calls(t.turn_a.tool_calls if t.turn_a else None) + DEL_CLOSE,
                style=DEL_STYLE,
            )
            calls.append(" ")
            calls.append(
                INS_OPEN + format_tool_calls(t.turn_b.tool_calls if t.turn_b else None) + INS_CLOSE,
                style=INS_STYLE,
            )
            parts.append(Group(calls) if wrap else calls)
    tools = tools_table(diff)
    if tools is not None:
        parts += [
            Text(""),
            Text("tool calls (in call order):", style="bold"),
            Group(tools) if wrap else tools,
        ]
    return parts


def print_parts(out: Any, parts: list[RenderableType]) -> None:
    """Print renderables; plain text goes out unwrapped (the terminal wraps it, much faster)."""
    from rich.text import Text

    for part in parts:
        out.print(part, soft_wrap=isinstance(part, Text))


def _indent(text: Text) -> Text:
    from rich.text import Text

    out = Text("    ")
    out.append_text(text)
    return out


#: --group's columns in the order shown: (header, right-aligned); the signals come after the reward.
GROUP_COLUMNS = (
    ("rollout_n", True),
    ("id", False),
    ("reward", True),
    *((name, True) for name in SIGNAL_COLUMNS),
    ("model_calls", True),
    ("response_tokens", True),
    ("tool_errors", True),
    ("diverges at", False),
)
#: The order in which a narrow terminal keeps them (as ``ls`` does: the first that fit).
GROUP_PRIORITY = (
    "rollout_n",
    "id",
    "reward",
    "advantage",
    "diverges at",
    "logprob_diff_max",
    "importance_ratio",
    "response_tokens",
    "model_calls",
    "tool_errors",
)
SAYS = ("best says: ", "this says: ")


def _diverges_at(member: Any) -> str:
    div = member.first_divergence
    if member.best:
        return "(best)"
    if div is None:
        return "identical"
    if div.response_offset is None:
        return f"prompt tok {div.token_offset}"
    return f"turn {div.turn} tok {div.token_offset} (resp {div.response_offset})"


def _cut(text: str, width: int | None) -> str:
    """``text`` in at most ``width`` characters (its end replaced by ``…``); all of it without one."""
    return text if width is None else elide(text, width)


def render_group(group: Any, text: bool, width: int | None = None) -> list[RenderableType]:
    """The group as aligned columns that fit ``width`` (a terminal's; None: every column), each
    diverging rollout followed by what the best rollout and it say from where they part."""
    from rich.text import Text

    split = "validate" if group.validate else "train"
    title = Text(
        f"group step={shown(group.step)} sample_index={shown(group.sample_index)} {split}: "
        f"{plural(len(group.members), 'rollout')}; best-rewarded {group.best_id[:12]}",
        style="bold",
    )
    columns_shown = [
        (name, right)
        for name, right in GROUP_COLUMNS
        if name not in SIGNAL_COLUMNS or any(getattr(m.side, name) is not None for m in group.members)
    ]
    cells: dict[str, list[str]] = {
        "rollout_n": [_index(m.side.rollout_n) for m in group.members],
        "id": [m.side.id[:12] for m in group.members],
        "reward": [_num(m.side.reward) for m in group.members],
        **{name: [signal_cell(getattr(m.side, name)) for m in group.members] for name in SIGNAL_COLUMNS},
        "model_calls": [str(m.side.model_calls) for m in group.members],
        "response_tokens": [f"{m.side.response_tokens:,}" for m in group.members],
        "tool_errors": [str(m.side.tool_errors) for m in group.members],
        "diverges at": [_diverges_at(m) for m in group.members],
    }
    widths = {name: max([len(name), *map(len, cells[name])]) for name, _ in columns_shown}
    if width is not None:
        by_priority = [name for name in GROUP_PRIORITY if name in widths]
        kept = set(by_priority[: fit_columns([widths[n] for n in by_priority], width)])
        columns_shown = [(name, right) for name, right in columns_shown if name in kept]

    def line(values: list[str]) -> str:
        out = [
            v.rjust(widths[name]) if right else v.ljust(widths[name])
            for v, (name, right) in zip(values, columns_shown)
        ]
        return "  ".join(out).rstrip()

    table = Text(line([name for name, _ in columns_shown]), style="bold")
    for i, member in enumerate(group.members):
        table.append("\n" + line([cells[name][i] for name, _ in columns_shown]))
        if member.preview is None and member.preview_best is None:
            continue
        for label, value in zip(SAYS, (member.preview_best, member.preview)):
            said = f"    {label}{_preview(value, text)}"
            table.append("\n" + _cut(said, width), style="dim" if label == SAYS[0] else None)
    return [title, Text(""), table]


def _preview(value: Any, text: bool) -> str:
    if value is None:
        return ""
    if text:
        return repr(value)[1:-1]
    return " ".join(map(str, value))


# ---- the command -------------------------------------------------------------------------------


def load_decoder(runs: list[Any], tokenizer: str | None, no_text: bool) -> Any:
    """The decoder for the runs' tokenizer (or --tokenizer); None when there is none to use."""
    if no_text:
        return None
    from rlreplay.text.token2text import Decoder, TokenizerUnavailable, resolve_tokenizer

    names = [resolve_tokenizer(r, tokenizer) for r in runs]
    name = next((n for n in names if n), None)
    if name is None:
        return None
    if len({n for n in names if n}) > 1:
        print(
            f"rlreplay: warning: the runs record different tokenizers; decoding both with {name}",
            file=sys.stderr,
        )
    try:
        return Decoder.load(name)
    except TokenizerUnavailable as exc:
        if tokenizer:
            raise
        print(f"rlreplay: warning: {exc}; showing token ids", file=sys.stderr)
        return None


def _warn(runs: list[Any]) -> None:
    seen: set[str] = set()
    for run in runs:
        for message in run.notes():
            if message not in seen:
                seen.add(message)
                print(f"rlreplay: warning: {message}", file=sys.stderr)


@app.command("diff")
@selection_options
def diff_command(
    a: Annotated[
        str,
        typer.Argument(
            metavar="RUN|A",
            help="The run directory (then A and B follow), or trajectory A: an id (or unique prefix), "
            "or a selector: step=5,sample_index=12,rollout_n=0 "
            f"(keys: {', '.join(k.name for k in SELECT_KEYS)}).",
        ),
    ],
    b: Annotated[
        str | None,
        typer.Argument(
            metavar="A|B",
            help="Trajectory B (A when the run comes first): an id or a selector; keys not given are "
            "A's (e.g. rollout_n=1, or step=500). Omitted with --run-b: the same keys in that run.",
        ),
    ] = None,
    extra: Annotated[
        str | None, typer.Argument(metavar="B", help="Trajectory B, when the run comes first.")
    ] = None,
    run: RunOption = None,
    run_b: Annotated[
        Path | None,
        typer.Option("--run-b", metavar="RUN", help="Run directory of B (default: the run of A)."),
    ] = None,
    tokenizer: TokenizerOption = None,
    no_text: Annotated[
        bool, typer.Option("--no-text", help="Compare token ids only; do not decode.")
    ] = False,
    no_text_was: NoTextWas = False,
    group: Annotated[
        bool,
        typer.Option("--group", help="Compare every rollout of A's sample with the best-rewarded one."),
    ] = False,
    side: Annotated[
        bool, typer.Option("--side-by-side", "-s", help="Two columns instead of inline.")
    ] = False,
    full: Annotated[
        bool, typer.Option("--full", help="Show equal turns and all context, untrimmed.")
    ] = False,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            metavar="FILE",
            help="Also write a self-contained HTML report to this file (never inside a run directory; "
            "an existing file only with --force).",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Let --html replace an existing file.")] = False,
    as_json: JsonOption = False,
    *,
    selection: Any,
) -> None:
    """Compare two trajectories, or a group, turn by turn.

    Shows the first divergence, changed text, reward, tools and timings."""
    from rlreplay.cli.browse import is_run_dir
    from rlreplay.diff import align as diffing
    from rlreplay.diff import pick

    no_text = NO_TEXT.take(no_text, no_text_was)
    run_path = None
    if is_run_dir(a):  # the run first, as on ls, show, info
        run_path, a, b, extra = Path(a), b, extra, None
        if a is None:
            fail("give trajectory A after the run (an id or a selector such as step=5,sample_index=12)")
    if extra is not None:
        fail(f"unexpected argument {extra!r}: diff takes [RUN] A [B]")
    run_a = open_run_arg(run, run_path)
    other = open_run_arg(run_b) if run_b is not None else run_a
    if group:
        if b is not None:
            fail("--group takes one trajectory (A); its group is every rollout of the same sample")
        if run_b is not None:
            fail("--group compares rollouts within one run; drop --run-b")
        if html is not None:
            fail("--html reports on a pair of trajectories; drop --group")
        traj = run_a.trajectory(pick.resolve(run_a, pick.parse_selector(a), one_group=True))
        decoder = load_decoder([run_a], tokenizer, no_text)
        result = diffing.diff_group(run_a, traj, decoder, selection)
        _warn([run_a])
        if as_json:
            typer.echo(orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2).decode())
            return
        print_parts(console(), render_group(result, decoder is not None, terminal_width()))
        return
    if html is not None:
        from rlreplay.diff.report import check_report_path

        check_report_path(html, force, [run_a.path, other.path])
    if selection != type(selection)():
        fail("--step, --where and the other selection options choose the rollouts of --group")
    traj_a, traj_b = pick.select_pair(run_a, a, other, b)
    decoder = load_decoder([run_a, other] if other is not run_a else [run_a], tokenizer, no_text)
    result = diffing.diff_trajectories(traj_a, traj_b, decoder, run_a, other)
    _warn([run_a, other])
    if html is not None:
        from rlreplay.diff.report import write_html

        write_html(result, html, force, [run_a.path, other.path])
    if as_json:
        payload = result.to_dict()
        if decoder is not None:
            payload["tokenizer"] = decoder.name
        typer.echo(orjson.dumps(payload, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode())
        return
    wrap = terminal_width() is not None
    print_parts(console(), render_diff(result, "side" if side else "unified", full, wrap))
