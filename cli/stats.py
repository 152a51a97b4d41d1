"""``rlreplay stats``: how a run moved over training, one row per step and split, with trends."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from rlreplay.cli.app import (
    ForceOption,
    JsonOption,
    RunArgument,
    RunOption,
    app,
    fail,
    left_out_note,
    open_run_arg,
    output_path,
    plural,
    report_warnings,
    selection_options,
    sparkline,
    terminal_width,
    text_table,
    write_atomically,
)
from rlreplay.errors import install_hint

PLOT_DEFAULT = (
    "reward_mean",
    "frac_groups_zero_std",
    "response_tokens_mean",
    "model_calls_mean",
    "tool_error_rate",
    "error_rate",
    "duration_p95_s",
)
PLOT_SUFFIXES = (".html", ".svg", ".png")
#: The columns a terminal shows first, as many as fit after step and split.
TERMINAL_FIRST = (
    "trajectories",
    "reward_mean",
    "frac_groups_zero_std",
    "tool_error_rate",
    "error_rate",
    "logprob_diff_mean",
    "response_tokens_mean",
)
COLORS = {"train": "#1f77b4", "val": "#ff7f0e", "all": "#2ca02c"}


@app.command("stats")
@selection_options
def stats_command(
    run_path: RunArgument = None,
    run: RunOption = None,
    columns: Annotated[
        str | None,
        typer.Option(
            "--columns",
            metavar="NAMES",
            help="Comma-separated stats columns to show and plot (default: all).",
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE",
            help="Write a chart of the columns over steps: FILE.html, FILE.svg or FILE.png.",
        ),
    ] = None,
    force: ForceOption = False,
    as_json: JsonOption = False,
    *,
    selection: Any,
) -> None:
    """Per-step metrics and their trends.

    One row per step and split: rewards, advantages, mismatch, group spread, lengths, tool use,
    errors and durations; then a sparkline per column."""
    from rlreplay.read.query import STATS_COLUMNS, stats

    chosen = _columns(columns, STATS_COLUMNS)
    target = None
    if plot is not None:
        if plot.suffix.lower() not in PLOT_SUFFIXES:
            fail(f"--plot {plot}: write a {', '.join(PLOT_SUFFIXES)} file")
        target = output_path(plot, force, "--plot")
    opened = open_run_arg(run, run_path)
    table = stats(opened, selection)
    report_warnings(opened)
    rows = table.to_pylist()
    metrics = [c for c in chosen if c not in ("step", "validate")]
    if columns is None:  # by default, only the columns this run has values in
        metrics = [c for c in metrics if any(_value(r[c]) is not None for r in rows)]
    if target is not None:
        plotted = [c for c in metrics if c in PLOT_DEFAULT] if columns is None else metrics
        write_atomically(target, lambda tmp: write_plot(tmp, target.suffix.lower(), rows, plotted, opened))
    if as_json:
        for row in rows:
            sys.stdout.write(orjson.dumps({c: row[c] for c in STATS_COLUMNS}).decode() + "\n")
        return
    # on a terminal, the most telling columns that fit (the trends below give every column);
    # --columns chooses, a pipe gets them all in their --json order
    width = terminal_width() if columns is None else None
    if width is not None:
        metrics = [c for c in TERMINAL_FIRST if c in metrics] + [
            c for c in metrics if c not in TERMINAL_FIRST
        ]
    shown = ["step", "split", *metrics]
    lines, left_out = _table(rows, shown, width)
    sys.stdout.write("\n".join([*lines, *left_out_note(left_out, "--columns NAMES, --json")]) + "\n")
    sys.stdout.write(_trends(rows, metrics))
    if target is not None:
        print(f"wrote {target}", file=sys.stderr)


def _columns(text: str | None, known: tuple[str, ...]) -> list[str]:
    if text is None:
        return list(known)
    names = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in names if c not in known]
    if unknown or not names:
        fail(
            f"--columns: unknown column {', '.join(map(repr, unknown)) or '(none given)'} "
            f"(columns: {', '.join(known)})"
        )
    return names


def split_name(validate: Any) -> str:
    return "all" if validate is None else "val" if validate else "train"


def _value(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(rows: list[dict[str, Any]], shown: list[str], width: int | None) -> tuple[list[str], list[str]]:
    cells = [[_fmt(r["step"]), split_name(r["validate"]), *(_fmt(r[c]) for c in shown[2:])] for r in rows]
    return text_table(shown, cells, width=width, right=[True] * len(shown))


def _by_split(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(split_name(row["validate"]), []).append(row)
    return out


def _series(
    rows: list[dict[str, Any]], column: str, by_split: dict[str, list[dict[str, Any]]] | None = None
) -> dict[str, list[tuple[Any, float | None]]]:
    """Per split, (step, value) of ``column`` (None for NaN); ``by_split``: ``rows`` grouped already."""
    return {
        split: [(r["step"], _value(r[column])) for r in split_rows]
        for split, split_rows in (by_split if by_split is not None else _by_split(rows)).items()
    }


def _trends(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    if not rows:
        return "no trajectories selected\n"
    width = max(len(c) for c in metrics) if metrics else 0
    lines = []
    by_split: dict[str, list[str]] = {}
    grouped = _by_split(rows)
    for column in metrics:
        for split, points in _series(rows, column, grouped).items():
            values = [v for _, v in points]
            present = [v for v in values if v is not None]
            if not present:
                continue
            ends = f"{_fmt(present[0])} → {_fmt(present[-1])}" if len(present) > 1 else _fmt(present[0])
            by_split.setdefault(split, []).append(f"  {column.ljust(width)}  {sparkline(values)}  {ends}")
    for split, split_lines in by_split.items():
        steps = [r["step"] for r in grouped[split]]
        span = f"step {_fmt(steps[0])}" if len(steps) == 1 else f"steps {_fmt(steps[0])} to {_fmt(steps[-1])}"
        lines.append(f"trends ({split}, {plural(len(steps), 'row')}, {span}):")
        lines += split_lines
    return ("\n" + "\n".join(lines) + "\n") if lines else ""


# --- charts -----------------------------------------------------------------------------------


def write_plot(path: Path, suffix: str, rows: list[dict[str, Any]], columns: list[str], run: Any) -> None:
    """Charts of ``columns`` over steps, one panel each, a line per split."""
    if not columns:
        fail("--plot: no numeric columns chosen (see --columns)")
    title = f"rlreplay stats: {run.path.name}"
    if suffix == ".png":
        _write_png(path, rows, columns, title)
        return
    panels = [_svg_panel(rows, column) for column in columns]
    if suffix == ".svg":
        height = sum(PANEL_H for _ in panels)
        body = "".join(
            f'<g transform="translate(0,{i * PANEL_H})">{panel}</g>' for i, panel in enumerate(panels)
        )
        path.write_text(
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{PANEL_W}" height="{height}" '
            f'font-family="sans-serif" font-size="11">{body}</svg>\n',
            encoding="utf-8",
        )
        return
    figures = "".join(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{PANEL_W}" height="{PANEL_H}" '
        f'font-family="sans-serif" font-size="11">{panel}</svg>'
        for panel in panels
    )
    legend = " ".join(
        f'<span style="color:{COLORS[s]}">&#9632; {s}</span>'
        for s in dict.fromkeys(split_name(r["validate"]) for r in rows)
    )
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{_esc(title)}</title><style>body{{font-family:sans-serif;margin:16px}}"
        ".grid{display:flex;flex-wrap:wrap;gap:12px}</style></head><body>"
        f"<h3>{_esc(title)}</h3><p>{_esc(run.address)} &middot; {legend}</p>"
        f"<div class='grid'>{figures}</div></body></html>\n",
        encoding="utf-8",
    )


PANEL_W, PANEL_H = 460, 190
_LEFT, _RIGHT, _TOP, _BOTTOM = 56, 12, 24, 28


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _x_positions(rows: list[dict[str, Any]]) -> dict[Any, float]:
    """Numeric steps at their value, other steps in order of appearance."""
    steps = list(dict.fromkeys(r["step"] for r in rows if r["step"] is not None))
    numeric = all(isinstance(s, int) for s in steps)
    return {s: float(s) if numeric else float(i) for i, s in enumerate(steps)}


def _svg_panel(rows: list[dict[str, Any]], column: str) -> str:
    xs = _x_positions(rows)
    series = _series(rows, column)
    points = [(xs[s], v) for pts in series.values() for s, v in pts if v is not None and s in xs]
    parts = [f'<text x="{_LEFT}" y="15" font-weight="bold">{_esc(column)}</text>']
    w, h = PANEL_W - _LEFT - _RIGHT, PANEL_H - _TOP - _BOTTOM
    parts.append(f'<rect x="{_LEFT}" y="{_TOP}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>')
    if not points:
        parts.append(f'<text x="{_LEFT + 8}" y="{_TOP + 20}" fill="#888">no values</text>')
        return "".join(parts)
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 1 if y0 else -1, y1 + 1 if y1 else 1

    def px(x: float) -> float:
        return _LEFT + (x - x0) / (x1 - x0) * w

    def py(y: float) -> float:
        return _TOP + h - (y - y0) / (y1 - y0) * h

    for label, y in ((_fmt(y1), y1), (_fmt(y0), y0)):
        parts.append(
            f'<text x="{_LEFT - 4}" y="{py(y) + 4:.1f}" text-anchor="end" fill="#555">{label}</text>'
        )
    steps = [s for s in xs if any(s == st for pts in series.values() for st, _ in pts)]
    for s, anchor in ((steps[0], "start"), (steps[-1], "end")) if steps else ():
        parts.append(
            f'<text x="{px(xs[s]):.1f}" y="{PANEL_H - 10}" text-anchor="{anchor}" fill="#555">'
            f"step {_esc(str(s))}</text>"
        )
    for split, pts in series.items():
        color = COLORS.get(split, "#333")
        coords = [(px(xs[s]), py(v)) for s, v in pts if v is not None and s in xs]
        if len(coords) > 1:
            line = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
            parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for (x, y), (s, v) in zip(coords, [(s, v) for s, v in pts if v is not None and s in xs]):
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}">'
                f"<title>{_esc(split)} step {_esc(str(s))}: {_fmt(v)}</title></circle>"
            )
    return "".join(parts)


def _write_png(path: Path, rows: list[dict[str, Any]], columns: list[str], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail(f"--plot FILE.png needs matplotlib ({install_hint('plot')}); or write FILE.html / FILE.svg")
    xs = _x_positions(rows)
    fig, axes = plt.subplots(len(columns), 1, figsize=(7, 2.2 * len(columns)), squeeze=False)
    for ax, column in zip(axes[:, 0], columns):
        for split, pts in _series(rows, column).items():
            kept = [(xs[s], v) for s, v in pts if v is not None and s in xs]
            if kept:
                ax.plot(*zip(*kept), marker="o", markersize=3, label=split, color=COLORS.get(split))
        ax.set_ylabel(column, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0, 0].set_title(title)
    axes[0, 0].legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
