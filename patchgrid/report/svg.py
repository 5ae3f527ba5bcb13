"""The report's figures as inline SVG: no script, a hover title on every cell and point."""
from __future__ import annotations

import html
import math
from functools import lru_cache

from .colours import GROUP_COLOURS, colour
from .figures import Heatmap, Scatter, scatter_range

FONT = "DejaVu Sans, Verdana, sans-serif"  # the face the layout is measured in (DejaVu Sans), or one as wide
SIZE, PAD, BAR_W = 11, 4, 14
UNIT_LINE = 12.5  # px between the lines of a colour bar's units (10 px type)
ASCENT, DESCENT = 0.93, 0.24  # of the font size: DejaVu Sans' ascent and descent (its text boxes' top and bottom)


@lru_cache(maxsize=4096)
def text_width(text: str, size: float = SIZE, bold: bool = False) -> float:
    """The width of `text` in px at `size` px, as DejaVu Sans draws it, with 6% to spare."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    face = FontProperties(family="DejaVu Sans", size=size, weight="bold" if bold else "normal")
    return TextToPath().get_text_width_height_descent(text, face, ismath=False)[0] * 1.06


def _text(x, y, text, cls, *, anchor="start", rotate=None, size=SIZE, bold=False) -> str:
    turn = "" if rotate is None else f' transform="rotate({rotate:g} {x:.1f} {y:.1f})"'
    weight = ' font-weight="600"' if bold else ""
    return (f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}"{weight}{turn}>'
            f'{html.escape(str(text))}</text>')


def _wrap(text: str, width: float, size: float) -> list[str]:
    """`text` in lines of at most `width` px, broken at spaces (a word longer than that its own line)."""
    lines = []
    for word in text.split():
        if lines and text_width(f"{lines[-1]} {word}", size) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines or [""]


def _tick(v: float) -> str:
    return "0" if v == 0 else f"{v:+.2g}"


def _step(extent: float, cell: float) -> int:
    """Every how many cells a label of `extent` px fits without touching the next."""
    return max(1, math.ceil((extent + 1) / cell))


class _Layout:
    """Where everything of a heatmap goes, from its labels' measured extents."""

    def __init__(self, h: Heatmap):
        self.cell_w = 14 if len(h.cols) > 16 else (26 if h.small else 44)
        self.cell_h = (14 if len(h.rows) <= 16 else 9) if h.small else (13 if len(h.rows) > 20 else 20)
        self.size = 10 if self.cell_w < 20 else SIZE  # of the column labels
        self.row_size = SIZE if self.cell_h >= 14 else 10
        self.rows = [str(r) for r in h.rows]
        self.cols = [str(c).replace("_", " ") if isinstance(c, str) else str(c) for c in h.cols]
        self.row_step = _step(self.row_size * (ASCENT + DESCENT), self.cell_h)
        self.rotated = any(isinstance(c, str) for c in h.cols)
        widths = [text_width(c, self.size) for c in self.cols]
        line = self.size * (ASCENT + DESCENT)
        # rotated labels 40 degrees when their baselines are a line apart at that slant, else upright (90)
        self.angle = 40 if self.cell_w * math.sin(math.radians(40)) >= line * 1.1 else 90
        self.col_step = 1 if self.rotated else _step(max(widths, default=0), self.cell_w)
        shown = [j for j in range(len(self.cols)) if j % self.col_step == 0]
        self.shown_cols = shown
        sin, cos = math.sin(math.radians(self.angle)), math.cos(math.radians(self.angle))
        ascent, descent = self.size * ASCENT, self.size * DESCENT
        if self.rotated:
            self.col_depth = max((widths[j] * sin + descent * cos for j in shown), default=0) + ascent * cos + 4
            reach = max(((widths[j] * cos + ascent * sin) - (j + 0.5) * self.cell_w for j in shown), default=0)
        else:
            self.col_depth = self.size + 6
            reach = max(0.0, widths[0] / 2 - self.cell_w / 2) if widths else 0.0
        shown_rows = [r for i, r in enumerate(self.rows) if i % self.row_step == 0]
        self.row_w = max((text_width(r, self.row_size) for r in shown_rows), default=0)
        axis_x = PAD + SIZE * (ASCENT + DESCENT)  # the row axis' title, upright
        self.left = max(axis_x + PAD + self.row_w + 4, axis_x + PAD + reach)
        self.top = 8
        self.grid_w, self.grid_h = self.cell_w * len(h.cols), self.cell_h * len(h.rows)
        self.title_w = text_width(h.col_axis, SIZE, bold=True)
        right = self.left + self.grid_w + (0 if self.rotated else max(0.0, widths[-1] / 2 - self.cell_w / 2))
        self.bar_x = right + 14
        self.ticks = [(h.limit, "top"), (0.0, "mid"), (-h.limit, "bottom")]
        self.tick_w = max(text_width(_tick(v)) for v, _ in self.ticks)
        self.bar_h = max(self.grid_h, 100.0)
        unit = 10
        self.units = _wrap(h.units, self.bar_h - 4, unit)
        self.bar_h = max(self.bar_h, max(text_width(u, unit) for u in self.units) + 4)
        self.units_x = self.bar_x + BAR_W + 4 + self.tick_w + 6
        self.width = max(self.units_x + len(self.units) * UNIT_LINE + PAD,
                         self.left + self.grid_w / 2 + self.title_w / 2 + PAD)
        base = self.top + self.grid_h
        self.axis_y = base + self.col_depth + SIZE * ASCENT + 4
        self.height = max(self.axis_y + SIZE * DESCENT + PAD, self.top + self.bar_h + SIZE * DESCENT + PAD)


def _cells(h: Heatmap, g: _Layout) -> list[str]:
    out = []
    for i, row in enumerate(h.rows):
        y = g.top + i * g.cell_h
        if i % g.row_step == 0:
            out.append(_text(g.left - 4, y + g.cell_h / 2 + g.row_size * 0.35, row, "tick-y", anchor="end",
                             size=g.row_size))
        for j, col in enumerate(h.cols):
            v, note = h.values[i][j], h.notes[i][j]
            tip = html.escape(f"{h.row_axis} {row}, {h.col_axis} {col}: {note}" if note else "no data")
            few = h.few(i, j)
            x = g.left + j * g.cell_w
            faded = ' fill-opacity="0.45"' if few else ""
            out.append(f'<rect x="{x}" y="{y}" width="{g.cell_w}" height="{g.cell_h}" fill="{colour(v, h.limit)}"'
                       f'{faded} stroke="#fff" stroke-width="0.5"><title>{tip}</title></rect>')
            if few:
                r = max(1.5, min(g.cell_w, g.cell_h) * 0.16)
                out.append(f'<circle class="few" cx="{x + g.cell_w / 2}" cy="{y + g.cell_h / 2}" r="{r:.1f}" '
                           f'fill="#333" pointer-events="none"/>')
    return out


def _col_labels(g: _Layout) -> list[str]:
    base = g.top + g.grid_h
    out = []
    for j in g.shown_cols:
        x = g.left + j * g.cell_w + g.cell_w / 2
        if g.rotated:
            # the label's end at its column, running down and to the left (upright: straight down)
            cos = math.cos(math.radians(g.angle))
            y = base + 3 + g.size * ASCENT * cos
            dx = g.size * 0.35 if g.angle == 90 else 0
            out.append(_text(x + dx, y, g.cols[j], "tick-x", anchor="end", rotate=-g.angle, size=g.size))
        else:
            out.append(_text(x, base + 3 + g.size * ASCENT, g.cols[j], "tick-x", anchor="middle", size=g.size))
    return out


def _colour_bar(h: Heatmap, g: _Layout) -> list[str]:
    """The colour scale from +limit (top) to -limit, its ticks, and its units (whole in its hover title)."""
    steps, out = 24, [f"<g class='colour-bar'><title>{html.escape(h.units)}</title>"]
    for k in range(steps):
        v = h.limit * (1 - 2 * k / (steps - 1))
        out.append(f'<rect x="{g.bar_x:.1f}" y="{g.top + k * g.bar_h / steps:.1f}" width="{BAR_W}" '
                   f'height="{g.bar_h / steps + 0.5:.1f}" fill="{colour(v, h.limit)}"/>')
    ys = {"top": g.top + SIZE * ASCENT, "mid": g.top + g.bar_h / 2 + SIZE * 0.35, "bottom": g.top + g.bar_h}
    for v, where in g.ticks:
        out.append(_text(g.bar_x + BAR_W + 4, ys[where], _tick(v), "bar-tick"))
    for k, line in enumerate(g.units):
        x = g.units_x + k * UNIT_LINE + 10 * ASCENT
        out.append(_text(x, g.top + g.bar_h / 2, line, "bar-label", anchor="middle", rotate=-90, size=10))
    return out + ["</g>"]


def svg_heatmap(h: Heatmap) -> str:
    """A heatmap as inline SVG: every label placed from its measured extent (none clipped, none over
    another), a colour bar with its units, a hover title on every cell with its pair count, and the
    cells of few pairs (Heatmap.few) faded with a dot."""
    g = _Layout(h)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{g.width:.0f}" height="{g.height:.0f}" '
           f'viewBox="0 0 {g.width:.0f} {g.height:.0f}" role="img" aria-label="{html.escape(h.title)}">',
           f'<g font-family="{FONT}" font-size="{SIZE}" fill="#222">']
    out += _cells(h, g) + _col_labels(g) + _colour_bar(h, g)
    centre = max(g.left + g.grid_w / 2, g.title_w / 2 + PAD)
    out.append(_text(centre, g.axis_y, h.col_axis, "axis", anchor="middle", bold=True))
    middle = g.top + g.grid_h / 2
    out.append(_text(PAD + SIZE * ASCENT, middle, h.row_axis, "axis", anchor="middle", rotate=-90, bold=True))
    out.append("</g></svg>")
    return "".join(out)


def svg_scatter(s: Scatter) -> str:
    size, left, top, bottom, legend_w = 300, 62, 10, 50, 110
    width, height = left + size + legend_w, top + size + bottom
    lo, hi = scatter_range(s.points)

    def px(v):
        return left + (v - lo) / (hi - lo) * size

    def py(v):
        return top + size - (v - lo) / (hi - lo) * size

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(s.title)}">',
           f'<g font-family="{FONT}" font-size="{SIZE}" fill="#222">',
           f'<rect x="{left}" y="{top}" width="{size}" height="{size}" fill="#fff" stroke="#999"/>']
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append(f'<line x1="{px(v):.1f}" y1="{top + size}" x2="{px(v):.1f}" y2="{top + size + 4}" stroke="#999"/>'
                   f'<text x="{px(v):.1f}" y="{top + size + 18}" text-anchor="middle">{v:+.2g}</text>'
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

