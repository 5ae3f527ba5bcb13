"""The report's figures as PNG files (matplotlib, Agg), one per figure beside the page."""
from __future__ import annotations

from pathlib import Path

from .colours import GROUP_COLOURS, MID, NEG, POS
from .figures import Heatmap, Scatter, scatter_range


def png_heatmap(h: Heatmap, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap, TwoSlopeNorm

    cmap = LinearSegmentedColormap.from_list("pg", [tuple(c / 255 for c in NEG), tuple(c / 255 for c in MID),
                                                    tuple(c / 255 for c in POS)])
    cmap = cmap.with_extremes(bad="#d9d9d9")
    data = np.array([[np.nan if v is None else v for v in row] for row in h.values], dtype=float)
    fig_w = max(4.0, 0.35 * len(h.cols) + 2.5) if len(h.cols) <= 16 else max(6.0, 0.22 * len(h.cols) + 2.5)
    fig_h = max(3.0, 0.2 * len(h.rows) + 1.8)
    fig, ax = plt.subplots(figsize=(min(fig_w, 14), min(fig_h, 12)), dpi=110)
    im = ax.imshow(data, cmap=cmap, norm=TwoSlopeNorm(vmin=-h.limit, vcenter=0.0, vmax=h.limit), aspect="auto",
                   interpolation="nearest")
    ax.set_xticks(range(len(h.cols)))
    ax.set_xticklabels([str(c).replace("_", " ") for c in h.cols], rotation=40 if isinstance(h.cols[0], str) else 0,
                       ha="right" if isinstance(h.cols[0], str) else "center", fontsize=8)
    ax.set_yticks(range(len(h.rows)))
    ax.set_yticklabels([str(r).replace("_", " ") for r in h.rows], fontsize=8)
    ax.set_xlabel(h.col_axis)
    ax.set_ylabel(h.row_axis)
    ax.set_title(h.title, fontsize=10)
    fig.colorbar(im, ax=ax, label=h.units, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def png_scatter(s: Scatter, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = scatter_range(s.points)
    fig, ax = plt.subplots(figsize=(5.2, 4.6), dpi=110)
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
    ax.set_title(s.title + (f"\n{s.note}" if s.note else ""), fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

