"""The report's figures as inline SVG: no script, a hover title on every cell and point."""
from __future__ import annotations

import html

from .colours import GROUP_COLOURS, colour
from .figures import Heatmap, Scatter, scatter_range


def svg_heatmap(h: Heatmap) -> str:
    cell_w = 14 if len(h.cols) > 16 else (26 if h.small else 44)
    cell_h = 9 if h.small else (12 if len(h.rows) > 20 else 20)
    left = 112 if any(isinstance(r, str) for r in h.rows) else 46
    top, bottom = 8, 78 if any(isinstance(c, str) for c in h.cols) else 40
    legend_w = 0 if h.small else 90
    width = left + cell_w * len(h.cols) + legend_w + 10
    height = top + cell_h * len(h.rows) + bottom
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(h.title)}">']
    out.append('<g font-family="system-ui, sans-serif" font-size="11" fill="#222">')
    for i, row in enumerate(h.rows):
        y = top + i * cell_h
        show = not h.small or i % 4 == 0 or i == len(h.rows) - 1
        if show and (cell_h >= 12 or i % 2 == 0 or isinstance(row, str)):
            out.append(f'<text x="{left - 4}" y="{y + cell_h - 2}" text-anchor="end">{html.escape(str(row))}</text>')
        for j, _ in enumerate(h.cols):
            v, note = h.values[i][j], h.notes[i][j]
            tip = html.escape(f"{h.row_axis} {row}, {h.col_axis} {h.cols[j]}: {note}" if note else "no data")
            out.append(f'<rect x="{left + j * cell_w}" y="{y}" width="{cell_w}" height="{cell_h}" '
                       f'fill="{colour(v, h.limit)}" stroke="#fff" stroke-width="0.5"><title>{tip}</title></rect>')
    base = top + cell_h * len(h.rows)
    for j, col in enumerate(h.cols):
        x = left + j * cell_w + cell_w / 2
        if isinstance(col, str):
            out.append(f'<text x="{x}" y="{base + 8}" transform="rotate(40 {x} {base + 8})">'
                       f'{html.escape(col.replace("_", " "))}</text>')
        elif len(h.cols) <= 16 or j % 2 == 0:
            out.append(f'<text x="{x}" y="{base + 13}" text-anchor="middle">{col}</text>')
    axis_y = height - 6
    out.append(f'<text x="{left + cell_w * len(h.cols) / 2}" y="{axis_y}" text-anchor="middle" font-weight="600">'
               f'{html.escape(h.col_axis)}</text>')
    out.append(f'<text x="12" y="{top + cell_h * len(h.rows) / 2}" text-anchor="middle" font-weight="600" '
               f'transform="rotate(-90 12 {top + cell_h * len(h.rows) / 2})">{html.escape(h.row_axis)}</text>')
    if not h.small:
        lx = left + cell_w * len(h.cols) + 24
        lh = max(80, cell_h * len(h.rows))
        steps = 24
        for k in range(steps):
            v = h.limit * (1 - 2 * k / (steps - 1))
            out.append(f'<rect x="{lx}" y="{top + k * lh / steps}" width="14" height="{lh / steps + 0.5}" '
                       f'fill="{colour(v, h.limit)}"/>')
        for v, y in ((h.limit, top + 8), (0.0, top + lh / 2 + 4), (-h.limit, top + lh)):
            out.append(f'<text x="{lx + 18}" y="{y}">{v:+.2g}</text>')
        out.append(f'<text x="{lx + 7}" y="{top + lh + 16}" text-anchor="middle" font-size="10">'
                   f'{html.escape(h.units)}</text>')
    out.append("</g></svg>")
    return "".join(out)



def svg_scatter(s: Scatter) -> str:
    size, left, top, bottom, legend_w = 300, 62, 10, 46, 110
    width, height = left + size + legend_w, top + size + bottom
    lo, hi = scatter_range(s.points)

    def px(v):
        return left + (v - lo) / (hi - lo) * size

    def py(v):
        return top + size - (v - lo) / (hi - lo) * size

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(s.title)}">',
           '<g font-family="system-ui, sans-serif" font-size="11" fill="#222">',
           f'<rect x="{left}" y="{top}" width="{size}" height="{size}" fill="#fff" stroke="#999"/>']
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append(f'<line x1="{px(v):.1f}" y1="{top + size}" x2="{px(v):.1f}" y2="{top + size + 4}" stroke="#999"/>'
                   f'<text x="{px(v):.1f}" y="{top + size + 15}" text-anchor="middle">{v:+.2g}</text>'
                   f'<line x1="{left - 4}" y1="{py(v):.1f}" x2="{left}" y2="{py(v):.1f}" stroke="#999"/>'
                   f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:+.2g}</text>')
    if lo < 0 < hi:
        out.append(f'<line x1="{left}" y1="{py(0):.1f}" x2="{left + size}" y2="{py(0):.1f}" stroke="#e3e3e3"/>'
                   f'<line x1="{px(0):.1f}" y1="{top}" x2="{px(0):.1f}" y2="{top + size}" stroke="#e3e3e3"/>')
    out.append(f'<line x1="{px(lo):.1f}" y1="{py(lo):.1f}" x2="{px(hi):.1f}" y2="{py(hi):.1f}" stroke="#555" '
               f'stroke-dasharray="4 3"><title>y = x: the estimate equals the exact effect</title></line>')
    for group in reversed(s.groups):  # the top sites drawn last, over the sample
        for x, y, g in s.points:
            if g == group:
                tip = html.escape(f"{g}: AtP estimate {x:+.3f}, exact effect {y:+.3f} ({s.on})")
                out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{GROUP_COLOURS.get(g, "#444")}" '
                           f'fill-opacity="0.75"><title>{tip}</title></circle>')
    out.append(f'<text x="{left + size / 2}" y="{height - 6}" text-anchor="middle" font-weight="600">'
               f'{html.escape(s.x_label)}</text>')
    out.append(f'<text x="12" y="{top + size / 2}" text-anchor="middle" font-weight="600" '
               f'transform="rotate(-90 12 {top + size / 2})">{html.escape(s.y_label)}</text>')
    lx = left + size + 14
    for k, group in enumerate(s.groups):
        n = sum(1 for *_, g in s.points if g == group)
        out.append(f'<circle cx="{lx + 5}" cy="{top + 12 + 18 * k}" r="4" fill="{GROUP_COLOURS.get(group, "#444")}"/>'
                   f'<text x="{lx + 14}" y="{top + 16 + 18 * k}">{group} ({n})</text>')
    out.append("</g></svg>")
    return "".join(out)

