"""A self-contained HTML report of a trajectory diff: no scripts, no external files.

Deletions are ``<del>`` (struck through), insertions ``<ins>`` (underlined), so the report reads
without colour too. Changed turns show A and B side by side; a switch at the top (plain CSS)
turns the page into one unified column. Equal turns fold away under ``<details>``.
"""

from __future__ import annotations

import contextlib
import html
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlreplay.diff.align import DELTA_FIELDS, EQUAL, TrajectoryDiff, TurnDiff, format_tool_calls
from rlreplay.errors import ReportPathError
from rlreplay.format.keys import key_fields
from rlreplay.format.manifest import MANIFEST
from rlreplay.shards.layout import SPANS_DIR

#: Rows of the summary table, named as in --json, ``ls`` and ``show``.
SUMMARY_FIELDS = ("reward", "status", *DELTA_FIELDS[1:])

STATUS_WORDS = {"equal": "equal", "changed": "changed", "only_a": "only in A", "only_b": "only in B"}

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #1b1b1b; background: #fff; }
h1 { font-size: 1.3em; margin: 0 0 .4em; }
.meta { font-family: ui-monospace, monospace; margin: .1em 0; }
.divergence { font-weight: 600; margin: .8em 0; padding: .4em .6em; background: #fff6d5;
  border-left: 4px solid #e0b400; }
table.summary { border-collapse: collapse; margin: .6em 0 1.2em; }
table.summary td, table.summary th { padding: .15em .8em; text-align: right; border-bottom: 1px solid #eee; }
table.summary td:first-child, table.summary th:first-child { text-align: left; }
.turn { border: 1px solid #ddd; border-radius: 6px; margin: .5em 0; }
.turn > .head, .turn > summary { padding: .35em .6em; font-weight: 600; background: #f6f6f6; }
.turn.changed > .head { background: #fdf0e6; }
.turn.only_a > .head { background: #fde8e8; }
.turn.only_b > .head { background: #e6f6e9; }
.turn.first { outline: 3px solid #e0b400; }
.sides { display: grid; grid-template-columns: 1fr 1fr; gap: 0; }
.sides > div { padding: .4em .6em; min-width: 0; }
.sides > div + div { border-left: 1px solid #ddd; }
.side-label { font-size: .8em; color: #666; font-weight: 600; }
.unified { display: none; padding: .4em .6em; }
pre, .body { font-family: ui-monospace, monospace; font-size: 13px; white-space: pre-wrap;
  word-break: break-word; margin: 0; }
del { background: #ffd7d5; color: #86181d; text-decoration: line-through; }
ins { background: #ccf2d4; color: #1a5c2a; text-decoration: underline; }
.calls { font-family: ui-monospace, monospace; font-size: 12px; padding: .2em .6em .5em; color: #444; }
.dim { color: #777; font-weight: 400; }
#unified:checked ~ main .sides { display: none; }
#unified:checked ~ main .unified { display: block; }
label.switch { font-size: .9em; margin-right: 1em; }
table.tools { border-collapse: collapse; font-family: ui-monospace, monospace; font-size: 12px; }
table.tools td, table.tools th { padding: .15em .6em; border-bottom: 1px solid #eee; text-align: left;
  vertical-align: top; }
.error { color: #b00020; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _items(value: Any, unit: str) -> str:
    return value if unit == "words" else " ".join(map(str, value))


def _sides(turn: TurnDiff) -> tuple[str, str, str]:
    """A's body (deletions marked), B's body (insertions marked), and the unified body."""
    left, right, unified = [], [], []
    sep = "" if turn.unit == "words" else " "
    segments = turn.segments
    if turn.status == EQUAL:
        value = (
            turn.turn_a.text
            if turn.unit == "words" and turn.turn_a and turn.turn_a.text is not None
            else None
        )
        shown = _e(
            value if value is not None else " ".join(map(str, turn.turn_a.token_ids if turn.turn_a else []))
        )
        return shown, shown, shown
    for seg in segments:
        if seg.op == EQUAL:
            text = _e(_items(seg.a, turn.unit))
            left.append(text)
            right.append(text)
            unified.append(text)
            continue
        old, new = _items(seg.a, turn.unit), _items(seg.b, turn.unit)
        if old:
            left.append(f"<del>{_e(old)}</del>")
            unified.append(f"<del>{_e(old)}</del>")
        if new:
            right.append(f"<ins>{_e(new)}</ins>")
            unified.append(f"<ins>{_e(new)}</ins>")
    return sep.join(left), sep.join(right), sep.join(unified)


def _turn_html(turn: TurnDiff, first: bool) -> str:
    idx_a = "–" if turn.index_a is None else turn.index_a
    idx_b = "–" if turn.index_b is None else turn.index_b
    idx = f"{idx_a}" if idx_a == idx_b else f"{idx_a} → {idx_b}"
    sizes = []
    if turn.turn_a is not None:
        sizes.append(f"A {len(turn.turn_a.token_ids):,} tokens")
    if turn.turn_b is not None:
        sizes.append(f"B {len(turn.turn_b.token_ids):,} tokens")
    detail = ", ".join(sizes)
    if turn.status == "changed":
        detail = f"first differs at token {turn.first_diff}; {detail}"
        if turn.same_text:
            detail += "; same text, different token ids"
    head = (
        f"turn {_e(idx)} · {_e(turn.role)} · {STATUS_WORDS[turn.status]} "
        f'<span class="dim">({_e(detail)})</span>'
    )
    left, right, unified = _sides(turn)
    classes = f"turn {turn.status}" + (" first" if first else "")
    anchor = ' id="first-divergence"' if first else ""
    body = (
        '<div class="sides">'
        f'<div><div class="side-label">A</div><div class="body">{left}</div></div>'
        f'<div><div class="side-label">B</div><div class="body">{right}</div></div>'
        "</div>"
        f'<div class="unified"><div class="body">{unified}</div></div>'
    )
    calls = ""
    if turn.role == "assistant" and turn.tool_calls_changed:
        old = _e(format_tool_calls(turn.turn_a.tool_calls if turn.turn_a else None))
        new = _e(format_tool_calls(turn.turn_b.tool_calls if turn.turn_b else None))
        calls = (
            f'<div class="calls">tool calls: <del class="call">{old}</del> '
            f'<ins class="call">{new}</ins></div>'
        )
    if turn.status == EQUAL:
        return f'<details class="{classes}"{anchor}><summary>{head}</summary>{body}</details>'
    return f'<section class="{classes}"{anchor}><div class="head">{head}</div>{body}{calls}</section>'


def _summary(diff: TrajectoryDiff) -> str:
    rows = [(name, name) for name in SUMMARY_FIELDS]
    deltas = diff.deltas
    out = ['<table class="summary"><tr><th></th><th>A</th><th>B</th><th>B−A</th></tr>']
    for label, name in rows:
        va, vb = getattr(diff.a, name), getattr(diff.b, name)
        delta = deltas.get(name)
        seconds = name.endswith("_s")
        shown = "" if delta in (None, 0) else f"{delta:+.3f}" if seconds else f"{delta:+.4g}"
        if seconds:
            va, vb = f"{va:.3f}", f"{vb:.3f}"
        if name == "status":
            shown = "" if va == vb else "changed"
        out.append(f"<tr><td>{_e(label)}</td><td>{_fmt(va)}</td><td>{_fmt(vb)}</td><td>{_e(shown)}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return _e(f"{value:.4g}")
    return _e(value)


def _tools(diff: TrajectoryDiff) -> str:
    if not diff.tools:
        return ""
    import orjson

    def cell(info: dict[str, Any] | None) -> str:
        if info is None:
            return "–"
        params = orjson.dumps(info["parameters"], option=orjson.OPT_NON_STR_KEYS).decode()
        text = f"{_e(info['name'])}({_e(params)}) {_e(info['status'])} {info['duration_s']:.3f}s"
        if info["error"]:
            text += f' <span class="error">{_e(info["error"])}</span>'
        return text

    rows = "".join(
        f"<tr><td>{STATUS_WORDS[t.status]}</td><td>{t.index}</td><td>{cell(t.a)}</td><td>{cell(t.b)}</td></tr>"
        for t in diff.tools
    )
    return (
        '<h2>Tool calls</h2><table class="tools"><tr><th></th><th>#</th><th>A</th><th>B</th></tr>'
        f"{rows}</table>"
    )


def _side_line(label: str, side: Any) -> str:
    split = "validate" if side.validate else "train"
    run = f" run={side.run}" if side.run else ""
    return (
        f'<p class="meta"><b>{label}</b> {_e(side.id)} {_e(key_fields(side))} {split} '
        f"experiment={_e('-' if side.experiment is None else side.experiment)}{_e(run)}</p>"
    )


def render_html(diff: TrajectoryDiff) -> str:
    """The whole report as one HTML document."""
    div = diff.first_divergence
    if div is None:
        where = "token ids identical (prompt and response)" + ("; no differences" if diff.identical else "")
        first_turn = None
    elif div.response_offset is None:
        where = f"first divergence: the prompt, token {div.token_offset}"
        first_turn = 0
    else:
        where = (
            f'first divergence: <a href="#first-divergence">turn {div.turn}</a>, token {div.token_offset} '
            f"of the turn, response token {div.response_offset}"
        )
        first_turn = div.turn
    key = "index_b" if div is not None and div.ended == "a" else "index_a"
    turns = "".join(
        _turn_html(t, first=first_turn is not None and getattr(t, key) == first_turn and t.status != EQUAL)
        for t in diff.turns
    )
    counts = diff.counts()
    count_line = (
        f"{counts['equal']} equal, {counts['changed']} changed, {counts['only_a']} only in A, "
        f"{counts['only_b']} only in B" + ("" if diff.text else " (compared as token ids)")
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>rlreplay diff {_e(diff.a.id[:12])} vs {_e(diff.b.id[:12])}</title>"
        f"<style>{CSS}</style></head><body>"
        '<input type="radio" name="layout" id="side" checked>'
        '<label class="switch" for="side">side by side</label>'
        '<input type="radio" name="layout" id="unified">'
        '<label class="switch" for="unified">unified</label>'
        "<main><h1>rlreplay diff</h1>"
        f"{_side_line('A', diff.a)}{_side_line('B', diff.b)}"
        f'<p class="divergence">{where}</p>'
        f"{_summary(diff)}<h2>Conversation</h2><p>{_e(count_line)}</p>{turns}{_tools(diff)}"
        "</main></body></html>"
    )


def _inside_run(path: Path, runs: list[Path]) -> Path | None:
    """The run directory that ``path`` (already resolved) lies in, if any."""
    for run in runs:
        if path.is_relative_to(run.resolve()):
            return run
    for parent in path.parents:
        if (parent / MANIFEST).is_file() or (parent / SPANS_DIR).is_dir():
            return parent
    return None


def check_report_path(path: str | Path, force: bool = False, runs: Sequence[Path] = ()) -> Path:
    """``path`` if a report may be written there; else ReportPathError with a one-line reason.

    Never inside a run directory (nor through a link into one), never over a directory, and over
    an existing file only with ``force``.
    """
    target = Path(path)
    if target.is_dir():
        raise ReportPathError(f"--html {target}: is a directory; give a file name")
    if not target.parent.is_dir():
        raise ReportPathError(f"--html {target}: no directory {target.parent}")
    real = target.parent.resolve() / target.name
    for where in {real, target.resolve()}:
        run = _inside_run(where, list(runs))
        if run is not None:
            raise ReportPathError(
                f"--html {target}: inside the run directory {run}; recorded runs are never written to"
            )
    exists = target.exists() or target.is_symlink()
    if exists and not force:
        raise ReportPathError(f"--html {target}: exists; pass --force to replace it")
    if exists and not (target.is_file() or target.is_symlink()):
        raise ReportPathError(f"--html {target}: not a regular file")
    return target


def write_html(
    diff: TrajectoryDiff, path: str | Path, force: bool = False, runs: Sequence[Path] = ()
) -> Path:
    """Write the report to ``path`` (UTF-8) and return it (see ``check_report_path``).

    The file is written beside the target and renamed over it: a link at ``path`` is replaced,
    never written through."""
    target = check_report_path(path, force, runs)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(render_html(diff))
        if force:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)  # fails if the name appeared meanwhile: nothing is overwritten
    except FileExistsError:
        raise ReportPathError(f"--html {target}: exists; pass --force to replace it") from None
    except OSError as exc:
        raise ReportPathError(f"--html {target}: cannot write ({exc.strerror or exc})") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return target
