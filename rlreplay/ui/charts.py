"""Small line charts drawn as inline SVG on the server: no script, no library."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from markupsafe import Markup, escape

W, H = 300, 120
PAD_L, PAD_R, PAD_T, PAD_B = 40, 8, 8, 18


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def line_chart(
    points: Sequence[tuple[int, float]], label: str, href: Callable[[int], str] | None = None
) -> Markup:
    """``points`` (step, value) as a polyline with one dot per step; a dot links to ``href(step)``."""
    pts = [(s, v) for s, v in points if s is not None and v is not None]
    title = f'<text x="{PAD_L}" y="{PAD_T + 2}" class="ct">{escape(label)}</text>'
    if not pts:
        return Markup(
            f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(label)}">{title}'
            f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="cn">no data</text></svg>'
        )
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y0 == y1:
        y0, y1 = y0 - 0.5 if y0 else 0.0, y1 + 0.5 if y1 else 1.0
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B - 10

    def px(x: float) -> float:
        return PAD_L + (pw * (x - x0) / (x1 - x0) if x1 != x0 else pw / 2)

    def py(y: float) -> float:
        return PAD_T + 10 + ph * (1 - (y - y0) / (y1 - y0))

    line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
    dots = []
    for x, y in pts:
        tip = f"<title>step {x}: {escape(_fmt(y))}</title>"
        dot = f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3">{tip}</circle>'
        dots.append(f'<a href="{escape(href(x))}">{dot}</a>' if href else dot)
    axes = (
        f'<line x1="{PAD_L}" y1="{H - PAD_B}" x2="{W - PAD_R}" y2="{H - PAD_B}" class="ax"/>'
        f'<line x1="{PAD_L}" y1="{PAD_T + 10}" x2="{PAD_L}" y2="{H - PAD_B}" class="ax"/>'
        f'<text x="{PAD_L - 3}" y="{py(y1) + 4:.1f}" text-anchor="end" class="cl">{_fmt(y1)}</text>'
        f'<text x="{PAD_L - 3}" y="{py(y0):.1f}" text-anchor="end" class="cl">{_fmt(y0)}</text>'
        f'<text x="{PAD_L}" y="{H - 4}" class="cl">{x0}</text>'
        f'<text x="{W - PAD_R}" y="{H - 4}" text-anchor="end" class="cl">step {x1}</text>'
    )
    return Markup(
        f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(label)}">{title}{axes}'
        f'<polyline points="{line}" class="cline"/>{"".join(dots)}</svg>'
    )
