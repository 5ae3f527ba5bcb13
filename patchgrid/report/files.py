"""The report's figures as files beside the page, each as PNG, SVG and PDF (matplotlib, no pyplot):
laid out by matplotlib's constrained layout, so that no label is clipped or drawn over another; a
heatmap's cells of few pairs (Heatmap.few) faded with a dot, as on the page."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

from .colours import GROUP_COLOURS, MID, NEG, POS, SERIES_COLOURS
from .figures import (
    CircuitDiagram,
    Curve,
    Heatmap,
    LayerCurve,
    Scatter,
    curve_range,
    layer_curve_range,
    scatter_range,
)

FORMATS = ("png", "svg", "pdf")  # every figure is written in each
DPI = 110
TICK_PT = 8  # tick labels' font size (points)
UNDATED = {".svg": {"Date": None}, ".pdf": {"CreationDate": None}}  # the same figure, the same bytes


def _rgb(c) -> tuple:
    return tuple(v / 255 for v in c)


def _wrapped(text: str, width_in: float, size_pt: float) -> str:
    """`text` broken into lines that fit `width_in` inches at `size_pt` (0.6 em a character, generous)."""
    return "\n".join(textwrap.wrap(text, max(12, int(width_in * 72 / (0.6 * size_pt))))) or text


def _figure(width_in: float, height_in: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")


def _ticks(n: int, length_in: float) -> list[int]:
    """The indices of the tick labels that fit along `length_in` inches, a label a line apart."""
    step = max(1, math.ceil(n * TICK_PT * 1.5 / 72 / max(length_in, 1e-6)))
    return list(range(0, n, step))


def heatmap_figure(h: Heatmap):
    """The heatmap as a matplotlib Figure (its colour bar labelled with the units)."""
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap, TwoSlopeNorm

    cmap = LinearSegmentedColormap.from_list("pg", [_rgb(NEG), _rgb(MID), _rgb(POS)]).with_extremes(bad="#d9d9d9")
    data = np.array([[np.nan if v is None else v for v in row] for row in h.values], dtype=float)
    rotated = any(isinstance(c, str) for c in h.cols)
    cell_w = 0.35 if len(h.cols) <= 16 else 0.22
    cell_h = 0.2 if len(h.rows) <= 40 else 0.16
    width = min(max(4.6, cell_w * len(h.cols) + 3.0), 16.0)
    height = min(max(3.2, cell_h * len(h.rows) + (2.6 if rotated else 1.9)), 14.0)
    fig = _figure(width, height)
    ax = fig.add_subplot()
    few = np.array([[h.few(i, j) for j in range(len(h.cols))] for i in range(len(h.rows))], dtype=bool)
    im = ax.imshow(data, cmap=cmap, norm=TwoSlopeNorm(vmin=-h.limit, vcenter=0.0, vmax=h.limit), aspect="auto",
                   interpolation="nearest", alpha=np.where(few, 0.45, 1.0))
    if few.any():
        ys, xs = np.nonzero(few)
        ax.scatter(xs, ys, s=9, color="#333", marker="o", linewidths=0)
    xs = _ticks(len(h.cols), width - 2.6) if not rotated else list(range(len(h.cols)))
    ax.set_xticks(xs, [str(h.cols[j]).replace("_", " ") for j in xs], fontsize=TICK_PT,
                  rotation=40 if rotated else 0, ha="right" if rotated else "center", rotation_mode="anchor")
    ys = _ticks(len(h.rows), height - 2.0)
    ax.set_yticks(ys, [str(h.rows[i]).replace("_", " ") for i in ys], fontsize=TICK_PT)
    ax.set_xlabel(h.col_axis)
    ax.set_ylabel(h.row_axis)
    ax.set_title(_wrapped(h.title, width - 0.3, 10), fontsize=10)
    bar = fig.colorbar(im, ax=ax, shrink=0.9)
    bar.ax.tick_params(labelsize=TICK_PT)
    bar.set_label(_wrapped(h.units, max(1.2, 0.9 * (height - 1.5)), 9), fontsize=9)
    return fig


def scatter_figure(s: Scatter):
    """Estimate against exact effect as a matplotlib Figure: the groups' points and the line y = x."""
    from matplotlib.ticker import MaxNLocator

    lo, hi = scatter_range(s.points)
    fig = _figure(5.4, 5.0)
    ax = fig.add_subplot()
    ax.plot([lo, hi], [lo, hi], ls="--", color="#555", lw=1, label="y = x")
    for group in reversed(s.groups):
        xs = [x for x, _, g in s.points if g == group]
        ys = [y for _, y, g in s.points if g == group]
        if xs:
            ax.scatter(xs, ys, s=12, alpha=0.75, color=GROUP_COLOURS.get(group, "#444"), label=f"{group} ({len(xs)})")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel(s.x_label)
    ax.set_ylabel(s.y_label)
    ax.set_title("\n".join(_wrapped(t, 5.0, 10) for t in (s.title, s.note) if t), fontsize=10)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, prune="lower"))  # none in the corner, over the x axis' first
    ax.legend(fontsize=8, loc="upper left")
    return fig


def curve_figure(c: Curve):
    """Faithfulness against the share of edges (log scale), a line per series, the pairs' intervals as bars."""
    (x0, x1), (y0, y1) = curve_range(c)
    fig = _figure(6.4, 4.0)
    ax = fig.add_subplot()
    for k, (label, points) in enumerate(c.series):
        col = SERIES_COLOURS[k % len(SERIES_COLOURS)]
        pts = [(s, f) for s, f, *_ in points if f is not None]
        ax.plot([s for s, _ in pts], [f for _, f in pts], marker="o", ms=3, color=col, label=label)
        for s, _, _, low, high in points:
            if low is not None and high is not None:
                ax.plot([s, s], [max(low, y0), min(high, y1)], color=col, alpha=0.45, lw=3)
    ax.set_xscale("log")
    ax.set_xlim(10 ** x0, 10 ** x1)
    ax.set_ylim(y0, y1)
    ax.axhline(1.0, color="#999", lw=0.8)
    ax.axhline(0.0, color="#999", lw=0.8)
    ax.set_xlabel(c.x_label)
    ax.set_ylabel(c.y_label)
    ax.set_title(_wrapped(c.title, 6.0, 10), fontsize=10)
    ax.legend(fontsize=8)
    return fig


def layer_curve_figure(c: LayerCurve):
    """A value by layer: a line per series with its interval as a translucent band, a dashed line at zero."""
    from matplotlib.ticker import MaxNLocator

    (x0, x1), (y0, y1) = layer_curve_range(c)
    fig = _figure(6.4, 4.0)
    ax = fig.add_subplot()
    nan = float("nan")
    for k, (label, points) in enumerate(c.series):
        col = SERIES_COLOURS[k % len(SERIES_COLOURS)]
        xs = [x for x, *_ in points]
        ax.fill_between(xs, [nan if lo is None else lo for _, _, lo, _ in points],
                        [nan if hi is None else hi for *_, hi in points], color=col, alpha=0.15, lw=0)
        ax.plot(xs, [nan if m is None else m for _, m, *_ in points], marker="o", ms=3, color=col, label=label)
    ax.axhline(0.0, color="#555", lw=0.8, ls="--")
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(c.x_label)
    ax.set_ylabel(c.y_label)
    ax.set_title(_wrapped(c.title, 6.0, 10), fontsize=10)
    ax.legend(fontsize=8)
    return fig


def circuit_figure(d: CircuitDiagram):
    """The circuit's nodes by layer (input at the bottom, logits at the top) and its edges coloured by score."""
    from .circuit_svg import diagram_layout
    from .colours import colour

    width, height, at = diagram_layout(d)
    fig = _figure(max(4.0, width / 80), max(3.0, height / 80))
    ax = fig.add_subplot()
    limit = d.limit
    for sender, receiver, score in sorted(d.edges, key=lambda e: abs(e[2])):
        for a in d.node(sender):
            for b in d.node(receiver):
                (x1, y1), (x2, y2) = at(*a), at(*b)
                ax.plot([x1, x2], [y1, y2], color=colour(score, limit), lw=0.4 + 1.6 * min(abs(score) / limit, 1),
                        alpha=0.8)
    for row in range(d.n_layers + 2):
        nodes = [(row, -1)] if row in (0, d.n_layers + 1) else [(row, c) for c in range(d.n_heads + 1)]
        ax.scatter([at(*n)[0] for n in nodes], [at(*n)[1] for n in nodes], s=6, color="#555", zorder=3)
    ax.set_yticks([at(r, 0)[1] for r in range(d.n_layers + 2)],
                  ["input"] + [f"layer {k}" for k in range(d.n_layers)] + ["logits"], fontsize=6)
    ax.set_xticks([])
    ax.invert_yaxis()
    ax.set_title(_wrapped(d.title, max(4.0, width / 80) - 0.5, 10), fontsize=10)
    return fig


FIGURES = {Heatmap: heatmap_figure, Scatter: scatter_figure, Curve: curve_figure, CircuitDiagram: circuit_figure,
           LayerCurve: layer_curve_figure}


def write_figure(figure: Heatmap | Scatter | Curve | CircuitDiagram | LayerCurve, folder: Path,
                 formats=FORMATS) -> list[Path]:
    """The figure as `<folder>/<key>.<format>` for each of `formats`; their paths."""
    fig = FIGURES[type(figure)](figure)
    paths = [Path(folder) / f"{figure.key}.{fmt}" for fmt in formats]
    for k, path in enumerate(paths):
        fig.savefig(path, metadata=UNDATED.get(path.suffix))
        if k == 0:  # laid out once: the other formats keep the first one's positions (and draw once each)
            fig.set_layout_engine(None)
    return paths
