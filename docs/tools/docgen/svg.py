"""Small static SVG charts for the docs.

Why hand-written SVG and not plotly: a figure must render in the built site *and* on a plain markdown
viewer (an `<img>` of a file), carry no JavaScript, and come out byte for byte the same from the same
data, so that a test can regenerate it and compare. The charts here are the few kinds the pages need:
lines over a numeric (optionally logarithmic) axis and bars (grouped or stacked, vertical or horizontal).
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
WIDTH, HEIGHT = 680, 380
FONT = "font-family=\"Helvetica, Arial, sans-serif\""
CHAR_W = 6.6  # average glyph width at 12 px, to lay out legends and labels without a text engine


def _sig(value):
    """Plotted values at 5 significant digits, as the exhibits store them: a last-bit difference of a
    floating-point sum on another machine must not move a point."""
    return None if value is None else float(f"{float(value):.5g}")


def fmt(value: float) -> str:
    """Tick and label text: thousands separators for whole numbers, three significant digits otherwise."""
    if value == 0:
        return "0"
    if float(value).is_integer() and abs(value) >= 1:
        return f"{value:,.0f}"
    digits = max(0, 2 - int(math.floor(math.log10(abs(value)))))
    text = f"{value:,.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    if ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


class _Canvas:
    def __init__(self, title: str, note: str, legend: list[tuple[str, str, bool]]):
        self.parts: list[str] = []
        self.title, self.note = title, note
        # legend rows: wrap the items to the width
        rows, row, used = [], [], 0.0
        for name, colour, dashed in legend:
            width = 28 + CHAR_W * len(name) + 18
            if row and used + width > WIDTH - 90:
                rows.append(row)
                row, used = [], 0.0
            row.append((name, colour, dashed, used))
            used += width
        if row:
            rows.append(row)
        self.legend_rows = rows
        self.top = 34 + 18 * len(rows) + 10
        self.bottom = HEIGHT - 52 - (16 if note else 0)

    def text(self, x: float, y: float, text: str, anchor: str = "middle", size: int = 12, extra: str = "") -> None:
        self.parts.append(f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" {FONT}{extra}>'
                          f"{escape(text)}</text>")

    def line(self, x1, y1, x2, y2, colour="#999", width=1.0, dashed=False) -> None:
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        self.parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{colour}" '
                          f'stroke-width="{width}"{dash}/>')

    def render(self) -> str:
        head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
                f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img">',
                f"<title>{escape(self.title)}</title>",
                f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>']
        body: list[str] = []
        body.append(f'<text x="16" y="22" font-size="14" font-weight="bold" {FONT}>{escape(self.title)}</text>')
        for i, row in enumerate(self.legend_rows):
            y = 40 + 18 * i
            for name, colour, dashed, offset in row:
                x = 70 + offset
                dash = ' stroke-dasharray="5,4"' if dashed else ""
                body.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 22:.1f}" y2="{y:.1f}" stroke="{colour}" '
                            f'stroke-width="3"{dash}/>')
                body.append(f'<text x="{x + 28:.1f}" y="{y + 4:.1f}" font-size="12" {FONT}>{escape(name)}</text>')
        if self.note:
            body.append(f'<text x="16" y="{HEIGHT - 10}" font-size="11" fill="#555" {FONT}>{escape(self.note)}</text>')
        return "\n".join(head + body + self.parts + ["</svg>"]) + "\n"


def line_chart(title: str, x_label: str, y_label: str, series: list[dict], *, log_x: bool = False,
               log_y: bool = False, x_ticks: list[float] | None = None, y_min: float | None = None,
               y_max: float | None = None, note: str = "") -> str:
    """Lines over x. series: [{"name", "x", "y", optional "dashed": bool}]; None in y leaves a gap."""
    series = [{**s, "x": [_sig(x) for x in s["x"]], "y": [_sig(y) for y in s["y"]]} for s in series]
    legend = [(s["name"], PALETTE[i % len(PALETTE)], bool(s.get("dashed"))) for i, s in enumerate(series)]
    c = _Canvas(title, note, legend)
    xs = [x for s in series for x in s["x"]]
    ys = [y for s in series for y in s["y"] if y is not None]
    tx = x_ticks or (None if log_x else nice_ticks(min(xs), max(xs)))
    if log_x:
        tx = tx or [10 ** p for p in range(math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs))) + 1)]
        fx = math.log10
    else:
        fx = float
    if log_y:  # decades that cover the data
        ty = [10.0 ** p for p in range(math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys))) + 1)]
        fy = math.log10
    else:
        ty = nice_ticks(min(ys) if y_min is None else y_min, max(ys) if y_max is None else y_max)
        fy = float
    x0, x1 = fx(min(min(xs), tx[0])), fx(max(max(xs), tx[-1]))
    y0, y1 = fy(ty[0]), fy(ty[-1])
    left, right = 78, WIDTH - 24

    def px(x: float) -> float:
        return left + (fx(x) - x0) / (x1 - x0) * (right - left)

    def py(y: float) -> float:
        return c.bottom - (fy(y) - y0) / (y1 - y0) * (c.bottom - c.top)

    _axes(c, left, right, [(px(t), fmt(t)) for t in tx], [(py(t), fmt(t)) for t in ty], x_label, y_label)
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        runs: list[list[str]] = [[]]
        for x, y in zip(s["x"], s["y"]):
            if y is None:
                runs.append([])
            else:
                runs[-1].append(f"{px(x):.1f},{py(y):.1f}")
        dash = ' stroke-dasharray="5,4"' if s.get("dashed") else ""
        for run in runs:
            if len(run) > 1:
                c.parts.append(f'<polyline points="{" ".join(run)}" fill="none" stroke="{colour}" '
                               f'stroke-width="2.2"{dash}/>')
            for point in run:
                cx, cy = point.split(",")
                c.parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.8" fill="{colour}"/>')
    return c.render()


def bar_chart(title: str, categories: list[str], series: list[dict], value_label: str, *,
              horizontal: bool = False, stacked: bool = False, note: str = "", labels: bool = True,
              category_label: str = "") -> str:
    """Bars per category. series: [{"name", "values"}] (one value per category; None or 0 draws nothing).
    Grouped side by side, or stacked; vertical, or horizontal with the categories down the left."""
    series = [{**s, "values": [_sig(v) for v in s["values"]]} for s in series]
    legend = [(s["name"], PALETTE[i % len(PALETTE)], False) for i, s in enumerate(series)]
    c = _Canvas(title, note, legend)
    totals = [sum(s["values"][j] or 0 for s in series) for j in range(len(categories))] if stacked else \
        [max(s["values"][j] or 0 for s in series) for j in range(len(categories))]
    ticks = nice_ticks(0, max(totals) if max(totals) > 0 else 1)
    top_value = ticks[-1]
    if horizontal:
        left = 16 + CHAR_W * max(len(cat) for cat in categories)
        right = WIDTH - 60
        band = (c.bottom - c.top) / len(categories)

        def pv(v: float) -> float:
            return left + v / top_value * (right - left)

        for t in ticks:
            c.line(pv(t), c.top, pv(t), c.bottom, "#e5e5e5")
            c.text(pv(t), c.bottom + 16, fmt(t))
        c.text((left + right) / 2, c.bottom + 34, value_label)
        for j, cat in enumerate(categories):
            y = c.top + j * band
            c.text(left - 6, y + band / 2 + 4, cat, anchor="end")
            _bars(c, series, j, stacked, pv, y + band * 0.15, band * 0.7, horizontal=True, labels=labels)
        c.line(left, c.top, left, c.bottom, "#333")
        return c.render()
    left, right = 78, WIDTH - 24
    band = (right - left) / len(categories)

    def pv(v: float) -> float:
        return c.bottom - v / top_value * (c.bottom - c.top)

    _axes(c, left, right, [], [(pv(t), fmt(t)) for t in ticks], category_label, value_label)
    # a few wide bars: wrap long labels onto lines; many narrow ones (one per layer): label every k-th
    width = max(4, int(band / CHAR_W) - 1)
    every = 1 if len(categories) <= 12 else math.ceil((max(len(cat) for cat in categories) * CHAR_W + 6) / band)
    for j, cat in enumerate(categories):
        x = left + j * band
        if j % every == 0:
            for i, line in enumerate(_wrap(cat, width) if every == 1 else [cat]):
                c.text(x + band / 2, c.bottom + 16 + 14 * i, line)
        _bars(c, series, j, stacked, pv, x + band * 0.12, band * 0.76, horizontal=False, labels=labels)
    return c.render()


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def _bars(c: _Canvas, series: list[dict], j: int, stacked: bool, pv, start: float, thickness: float,
          horizontal: bool, labels: bool) -> None:
    base = 0.0
    width = thickness if stacked else thickness / len(series)
    for i, s in enumerate(series):
        raw = s["values"][j]
        value = raw or 0
        colour = PALETTE[i % len(PALETTE)]
        offset = start if stacked else start + i * width
        lo, hi = (base, base + value) if stacked else (0.0, value)
        if value > 0:
            if horizontal:
                c.parts.append(f'<rect x="{pv(lo):.1f}" y="{offset:.1f}" width="{pv(hi) - pv(lo):.1f}" '
                               f'height="{width:.1f}" fill="{colour}"/>')
            else:
                c.parts.append(f'<rect x="{offset:.1f}" y="{pv(hi):.1f}" width="{width:.1f}" '
                               f'height="{pv(lo) - pv(hi):.1f}" fill="{colour}"/>')
        if labels and not stacked and raw is not None:
            if horizontal:
                c.text(pv(hi) + 4, offset + width / 2 + 4, fmt(value), anchor="start", size=11)
            else:
                c.text(offset + width / 2, pv(hi) - 4, fmt(value), size=11)
        base += value
    if labels and stacked:
        total = base
        if horizontal:
            c.text(pv(total) + 4, start + thickness / 2 + 4, fmt(total), anchor="start", size=11)
        else:
            c.text(start + thickness / 2, pv(total) - 4, fmt(total), size=11)


def _axes(c: _Canvas, left: float, right: float, x_ticks: list[tuple[float, str]], y_ticks: list[tuple[float, str]],
          x_label: str, y_label: str) -> None:
    for y, text in y_ticks:
        c.line(left, y, right, y, "#e5e5e5")
        c.text(left - 6, y + 4, text, anchor="end")
    for x, text in x_ticks:
        c.line(x, c.bottom, x, c.bottom + 4, "#333")
        c.text(x, c.bottom + 17, text)
    c.line(left, c.bottom, right, c.bottom, "#333")
    c.line(left, c.top, left, c.bottom, "#333")
    if x_label:
        c.text((left + right) / 2, c.bottom + 36, x_label)
    if y_label:
        mid = (c.top + c.bottom) / 2
        c.text(18, mid, y_label, extra=f' transform="rotate(-90 18 {mid:.1f})"')
