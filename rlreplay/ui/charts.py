"""Charts drawn as inline SVG on the server: trends over steps, histograms, dot strips."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

W, H = 340, 150
PAD_L, PAD_R, PAD_T, PAD_B = 50, 10, 22, 30


def fmt(v: float | None) -> str:
    if v is None:
        return "–"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.3g}"


def _tipped(tag: str, attrs: str, tip: str) -> str:
    """An SVG element that shows ``tip`` on hover (``data-tip`` for the page's tooltip)."""
    t = escape(tip)
    return f'<{tag} {attrs} data-tip="{t}"><title>{t}</title></{tag}>'


def _svg(cls: str, label: str, body: str) -> Markup:
    a = escape(label)
    return Markup(f'<svg class="{cls}" viewBox="0 0 {W} {H}" role="img" aria-label="{a}">{body}</svg>')


@dataclass
class Series:
    """One line of a trend chart: a value per step (None where the step has none)."""

    label: str
    values: Sequence[float | None]


def _bounds(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if lo == hi:
        pad = abs(lo) * 0.1 or 0.5
        return lo - pad, hi + pad
    return lo, hi


def _frame(label: str, y0: float, y1: float, py: Callable[[float], float], x_labels: str) -> str:
    ticks = "".join(
        f'<line x1="{PAD_L - 3}" x2="{W - PAD_R}" y1="{py(v):.1f}" y2="{py(v):.1f}" class="grid"/>'
        f'<text x="{PAD_L - 5}" y="{py(v) + 3:.1f}" text-anchor="end" class="cl">{escape(fmt(v))}</text>'
        for v in (y0, (y0 + y1) / 2, y1)
    )
    return (
        f'<text x="{PAD_L}" y="14" class="ct">{escape(label)}</text>{ticks}'
        f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" class="ax"/>'
        f'<line x1="{PAD_L}" y1="{PAD_T}" x2="{PAD_L}" y2="{H - PAD_B}" class="ax"/>{x_labels}'
    )


def trend_chart(
    label: str,
    steps: Sequence[int],
    lines: Sequence[Series],
    band: tuple[Series, Series] | None = None,
    href: Callable[[int], str] | None = None,
) -> Markup:
    """Lines over steps (and a shaded band between two series); each step is a column that shows
    its values on hover and links to ``href(step)``."""
    every = [v for s in [*lines, *(band or ())] for v in s.values if v is not None and math.isfinite(v)]
    aria = escape(label)
    if not steps or not every:
        return Markup(
            f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="{aria}">'
            f'<text x="{PAD_L}" y="14" class="ct">{aria}</text>'
            f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="cn">no data</text></svg>'
        )
    y0, y1 = _bounds(every)
    x0, x1 = min(steps), max(steps)
    pw, ph = W - PAD_L - PAD_R - 8, H - PAD_T - PAD_B

    def px(x: float) -> float:
        return PAD_L + 4 + (pw * (x - x0) / (x1 - x0) if x1 != x0 else pw / 2)

    def py(y: float) -> float:
        return PAD_T + ph * (1 - (y - y0) / (y1 - y0))

    x_labels = (
        f'<text x="{px(x0):.1f}" y="{H - PAD_B + 12}" text-anchor="middle" class="cl">{x0}</text>'
        f'<text x="{px(x1):.1f}" y="{H - PAD_B + 12}" text-anchor="middle" class="cl">{x1}</text>'
        f'<text x="{(PAD_L + W - PAD_R) / 2:.1f}" y="{H - 4}" text-anchor="middle" class="cl">step</text>'
    )
    parts = [_frame(label, y0, y1, py, x_labels)]
    if band is not None:
        lo = [(s, v) for s, v in zip(steps, band[0].values) if v is not None]
        hi = [(s, v) for s, v in zip(steps, band[1].values) if v is not None]
        if lo and hi:
            pts = [f"{px(s):.1f},{py(v):.1f}" for s, v in hi] + [
                f"{px(s):.1f},{py(v):.1f}" for s, v in lo[::-1]
            ]
            parts.append(f'<polygon points="{" ".join(pts)}" class="band"/>')
    for k, series in enumerate(lines):
        pts = [(s, v) for s, v in zip(steps, series.values) if v is not None and math.isfinite(v)]
        if len(pts) > 1:
            line = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
            parts.append(f'<polyline points="{line}" class="cline c{k}"/>')
        parts += [f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="2.5" class="c{k}"/>' for s, v in pts]
    half = pw / max(len(steps) - 1, 1) / 2 if len(steps) > 1 else pw / 2
    for i, step in enumerate(steps):
        shown = [(s.label, s.values[i]) for s in (*lines, *(band or ()))]
        tip = f"step {step} · " + " · ".join(f"{name} {fmt(v)}" for name, v in shown)
        box = f'x="{px(step) - half:.1f}" y="{PAD_T}" width="{2 * half:.1f}" height="{ph}"'
        rect = _tipped("rect", f'class="hit" {box} data-step="{step}"', tip)
        parts.append(f'<a class="point" href="{escape(href(step))}">{rect}</a>' if href else rect)
    legend = ""
    if len(lines) > 1 or band is not None:
        names = [f'<tspan class="c{k}">■ {escape(s.label)}</tspan>' for k, s in enumerate(lines)]
        if band is not None:
            names.append(f'<tspan class="bandkey">■ {escape(band[0].label)}–{escape(band[1].label)}</tspan>')
        legend = f'<text x="{W - PAD_R}" y="{H - 4}" text-anchor="end" class="lg">{" ".join(names)}</text>'
    return _svg("chart", label, "".join(parts) + legend)


def histogram(label: str, values: Sequence[float], bins: int = 20) -> Markup:
    """Counts of ``values`` in equal bins; each bar shows its range and count on hover."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    aria = escape(label)
    if not vals:
        return Markup(
            f'<svg class="chart hist" viewBox="0 0 {W} {H}" role="img" aria-label="{aria}">'
            f'<text x="{PAD_L}" y="14" class="ct">{aria}</text>'
            f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="cn">no data</text></svg>'
        )
    lo, hi = min(vals), max(vals)
    n = bins if hi > lo else 1
    width = (hi - lo) / n if hi > lo else 1.0
    counts = [0] * n
    for v in vals:
        counts[min(int((v - lo) / width), n - 1) if hi > lo else 0] += 1
    top = max(counts)
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B

    def py(c: float) -> float:
        return PAD_T + ph * (1 - c / top)

    x_labels = (
        f'<text x="{PAD_L}" y="{H - PAD_B + 12}" class="cl">{escape(fmt(lo))}</text>'
        f'<text x="{W - PAD_R}" y="{H - PAD_B + 12}" text-anchor="end" class="cl">{escape(fmt(hi))}</text>'
        f'<text x="{(PAD_L + W - PAD_R) / 2:.1f}" y="{H - 4}" text-anchor="middle" class="cl">{aria}</text>'
    )
    parts = [_frame(f"{label} ({len(vals)})", 0, top, py, x_labels)]
    bw = pw / n
    for i, c in enumerate(counts):
        a, b = lo + i * width, lo + (i + 1) * width
        tip = f"{label} {fmt(a)} … {fmt(b)}: {c}" if hi > lo else f"{label} {fmt(lo)}: {c}"
        box = f'x="{PAD_L + i * bw + 0.5:.1f}" y="{py(c):.1f}" width="{max(bw - 1, 0.5):.1f}"'
        parts.append(
            _tipped("rect", f'class="hbar" {box} height="{H - PAD_B - py(c):.1f}" data-count="{c}"', tip)
        )
    return _svg("chart hist", label, "".join(parts))


def dots(values: Sequence[float | None], lo: float, hi: float, tips: Sequence[str]) -> Markup:
    """One dot per value on a small strip from ``lo`` to ``hi`` (a group's rewards)."""
    w, h, pad = 120, 14, 5
    span = (hi - lo) or 1.0
    out = [f'<line x1="{pad}" x2="{w - pad}" y1="{h / 2}" y2="{h / 2}" class="ax"/>']
    for v, tip in zip(values, tips):
        if v is None:
            continue
        x = pad + (w - 2 * pad) * ((v - lo) / span if hi > lo else 0.5)
        out.append(_tipped("circle", f'cx="{x:.1f}" cy="{h / 2}" r="3.5"', tip))
    return Markup(f'<svg class="dots" viewBox="0 0 {w} {h}" width="{w}" height="{h}">{"".join(out)}</svg>')
