"""Curves (a circuit's faithfulness by size, a value by layer) and a circuit's diagram as inline SVG (svg.py
draws the heatmaps and scatters)."""
from __future__ import annotations

import html
import math

from .colours import SERIES_COLOURS, colour
from .figures import CircuitDiagram, Curve, LayerCurve, axis_ticks, curve_range, layer_curve_range
from .svg import FONT, SIZE, text_width


def svg_curve(c: Curve) -> str:
    w, h, left, top, bottom, legend_w = 380, 260, 52, 10, 46, 190
    width, height = left + w + legend_w, top + h + bottom
    (x0, x1), (y0, y1) = curve_range(c)

    def px(share):
        return left + (math.log10(share) - x0) / (x1 - x0) * w

    def py(v):
        return top + h - (min(max(v, y0), y1) - y0) / (y1 - y0) * h

    out = _frame(c.title, width, height, left, top, w, h)
    for e in range(math.ceil(x0), math.floor(x1) + 1):
        x = px(10 ** e)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + h + 4}" stroke="#e3e3e3"/>'
                   f'<text x="{x:.1f}" y="{top + h + 17}" text-anchor="middle">{10 ** e * 100:g}%</text>')
    for v in (0.0, 0.5, 1.0):
        if y0 <= v <= y1:
            out.append(f'<line x1="{left - 4}" y1="{py(v):.1f}" x2="{left + w}" y2="{py(v):.1f}" '
                       f'stroke="{"#999" if v != 0.5 else "#e3e3e3"}"/>'
                       f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    for k, (label, points) in enumerate(c.series):
        col = SERIES_COLOURS[k % len(SERIES_COLOURS)]
        line = [(px(s), py(f)) for s, f, *_ in points if f is not None]
        if line:
            out.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.6" points="'
                       + " ".join(f"{x:.1f},{y:.1f}" for x, y in line) + '"/>')
        for share, f, mean, low, high in points:
            if low is not None and high is not None:
                out.append(f'<line x1="{px(share):.1f}" y1="{py(low):.1f}" x2="{px(share):.1f}" y2="{py(high):.1f}" '
                           f'stroke="{col}" stroke-opacity="0.45" stroke-width="3"/>')
            if f is not None:
                tip = f"{label}: {share * 100:g}% of edges, faithfulness {f:.3f}"
                if mean is not None:
                    tip += f"; mean of pairs {mean:.3f}" + (f" ({low:.3f} to {high:.3f})" if low is not None else "")
                out.append(f'<circle cx="{px(share):.1f}" cy="{py(f):.1f}" r="3" fill="{col}">'
                           f'<title>{html.escape(tip)}</title></circle>')
        out.append(_legend_entry(k, label, col, left + w, top))
    return "".join(out + _axis_labels(c, left, w, top, h, height))


def _frame(title: str, width: float, height: float, left: float, top: float, w: float, h: float) -> list[str]:
    """A plot's opening: the SVG element, its font group, the plot area's frame."""
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">',
            f'<g font-family="{FONT}" font-size="{SIZE}" fill="#222">',
            f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="#fff" stroke="#999"/>']


def _legend_entry(k: int, label: str, col: str, x: float, top: float) -> str:
    """Series k's line and label in a legend right of the plot, whose right edge is at x."""
    return (f'<line x1="{x + 14}" y1="{top + 12 + 18 * k}" x2="{x + 30}" y2="{top + 12 + 18 * k}" '
            f'stroke="{col}" stroke-width="2"/><text x="{x + 36}" y="{top + 16 + 18 * k}">{html.escape(label)}</text>')


def _axis_labels(c, left: float, w: float, top: float, h: float, height: float) -> list[str]:
    """A curve's x and y axis labels, and the figure's end."""
    return [f'<text x="{left + w / 2}" y="{height - 6}" text-anchor="middle" font-weight="600">'
            f'{html.escape(c.x_label)}</text>',
            f'<text x="12" y="{top + h / 2}" text-anchor="middle" font-weight="600" '
            f'transform="rotate(-90 12 {top + h / 2})">{html.escape(c.y_label)}</text>', "</g></svg>"]


def _stretches(points, index: int) -> list[list]:
    """The points in runs of consecutive ones whose item `index` is set (a line or band breaks at a gap)."""
    out, run = [], []
    for p in points:
        if p[index] is not None:
            run.append(p)
        elif run:
            out.append(run)
            run = []
    return out + ([run] if run else [])


def _layer_series(label: str, points, col: str, px, py) -> list[str]:
    """One series of a LayerCurve: its interval as a translucent band, its means as a line with markers."""
    out = []
    for run in _stretches(points, 2):
        band = [(px(x), py(lo)) for x, _, lo, _ in run] + [(px(x), py(hi)) for x, _, _, hi in reversed(run)]
        out.append(f'<polygon fill="{col}" fill-opacity="0.15" stroke="none" points="'
                   + " ".join(f"{x:.1f},{y:.1f}" for x, y in band) + '"/>')
    for run in _stretches(points, 1):
        out.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.6" points="'
                   + " ".join(f"{px(x):.1f},{py(m):.1f}" for x, m, *_ in run) + '"/>')
    for x, mean, low, high in points:
        if mean is not None:
            tip = f"{label}: layer {x}, {mean:+.3g}" + ("" if low is None else f" (95% t interval {low:+.3g} to "
                                                                           f"{high:+.3g})")
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(mean):.1f}" r="2.6" fill="{col}">'
                       f'<title>{html.escape(tip)}</title></circle>')
    return out


def svg_layer_curve(c: LayerCurve) -> str:
    """A value by layer: a line per series with its interval as a band, a dashed line at zero, a legend."""
    legend_w = 40 + max([text_width(label) for label, _ in c.series] + [40])
    w, h, left, top, bottom = 420, 260, 56, 10, 46
    width, height = round(left + w + legend_w), top + h + bottom
    (x0, x1), (y0, y1) = layer_curve_range(c)

    def px(layer):
        return left + (layer - x0) / (x1 - x0) * w

    def py(v):
        return top + h - (min(max(v, y0), y1) - y0) / (y1 - y0) * h

    out = _frame(c.title, width, height, left, top, w, h)
    first, last = math.ceil(x0), math.floor(x1)
    for layer in range(first, last + 1, max(1, math.ceil((last - first + 1) / 16))):
        out.append(f'<line x1="{px(layer):.1f}" y1="{top + h}" x2="{px(layer):.1f}" y2="{top + h + 4}" stroke="#999"/>'
                   f'<text x="{px(layer):.1f}" y="{top + h + 17}" text-anchor="middle">{layer}</text>')
    for v in axis_ticks(y0, y1):
        out.append(f'<line x1="{left - 4}" y1="{py(v):.1f}" x2="{left + w}" y2="{py(v):.1f}" stroke="#e3e3e3"/>'
                   f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
    out.append(f'<line x1="{left}" y1="{py(0):.1f}" x2="{left + w}" y2="{py(0):.1f}" stroke="#555" '
               f'stroke-dasharray="4 3"/>')
    for k, (label, points) in enumerate(c.series):
        col = SERIES_COLOURS[k % len(SERIES_COLOURS)]
        out += _layer_series(label, points, col, px, py)
        out.append(_legend_entry(k, label, col, left + w, top))
    return "".join(out + _axis_labels(c, left, w, top, h, height))


def diagram_layout(d: CircuitDiagram) -> tuple[float, float, callable]:
    """The diagram's width, height, and where a (row, column) node sits (px)."""
    cols = d.n_heads + 1
    col_w = max(12.0, min(40.0, 560.0 / cols))
    row_h = max(9.0, min(26.0, 620.0 / (d.n_layers + 2)))
    left, top = 64, 12
    width, height = left + cols * col_w + 20, top + (d.n_layers + 2) * row_h + 10

    def at(row: int, col: int) -> tuple[float, float]:
        x = left + (cols * col_w) / 2 if col < 0 else left + (col + 0.5) * col_w
        return x, top + (d.n_layers + 1 - row + 0.5) * row_h

    return width, height, at


def svg_circuit(d: CircuitDiagram) -> str:
    width, height, at = diagram_layout(d)
    limit = d.limit
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{html.escape(d.title)}">',
           f'<g font-family="{FONT}" font-size="{SIZE - 1}" fill="#222">']
    used = set()
    for sender, receiver, score in sorted(d.edges, key=lambda e: abs(e[2])):
        for a in d.node(sender):
            for b in d.node(receiver):
                used.update((a, b))
                (x1, y1), (x2, y2) = at(*a), at(*b)
                tip = f"{sender} → {receiver}: mean score {score:+.3f}"
                width = 0.6 + 2.4 * min(abs(score) / limit, 1)
                out.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                           f'stroke="{colour(score, limit)}" stroke-width="{width:.2f}" '
                           f'stroke-opacity="0.8"><title>{html.escape(tip)}</title></line>')
    for row in range(d.n_layers + 2):
        y = at(row, 0)[1]
        label = "input" if row == 0 else "logits" if row == d.n_layers + 1 else f"layer {row - 1}"
        out.append(f'<text x="4" y="{y + 4:.1f}">{label}</text>')
        nodes = [(row, -1)] if row in (0, d.n_layers + 1) else [(row, c) for c in range(d.n_heads + 1)]
        for node in nodes:
            x, y = at(*node)
            fill = "#222" if node in used else "#d9d9d9"
            if node[1] == d.n_heads:  # an MLP
                out.append(f'<rect x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6" fill="{fill}"/>')
            else:
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{fill}"/>')
    out.append("</g></svg>")
    return "".join(out)
