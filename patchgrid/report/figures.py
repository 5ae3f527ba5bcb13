"""The report's figures as data: a heatmap, a scatter plot, a curve or a circuit with its labels, hover
texts and caption, and the helpers that lay rows of a view out as a grid or an axis. Drawn by svg.py
and circuit_svg.py on the page, by files.py as files."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..metrics import METRICS
from ..rows.shapes import POSITION_ROLES as ROLE_ORDER

# The metric shown first (and the only one for the small multiples): the first of these the run has.
# logprob_diff: every pair has it (answers of any length), and for one-token answers it equals logit_diff
HEADLINE = ("logprob_diff", "logit_diff")
# A cell averaged over fewer pairs than this is drawn faded with a dot in it (its caption says so): a
# mean of one or two pairs is no estimate of the population's, and must not look as strong as one of forty.
FEW_PAIRS = 5


def pairs(n: int, unit: str = "pair") -> str:
    """`n` with its unit, singular or plural: 1 pair, 2 pairs."""
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


@dataclass
class Heatmap:
    key: str  # file stem of its PNG
    title: str
    rows: list  # row labels (top to bottom)
    cols: list  # column labels (left to right)
    values: list  # [row][col] -> float | None
    notes: list  # [row][col] -> hover text
    row_axis: str
    col_axis: str
    units: str
    limit: float  # colour scale from -limit to +limit
    caption: str = ""
    small: bool = False
    metric: str | None = None  # set: one of a figure's versions per metric, shown when it is selected
    extra: dict = field(default_factory=dict)
    counts: list | None = None  # [row][col] -> how many pairs (count_unit) the cell averages, None: no data
    count_unit: str = "pair"

    def few(self, i: int, j: int) -> bool:
        """Whether cell (i, j) averages fewer than FEW_PAIRS pairs (and is marked so)."""
        n = None if self.counts is None else self.counts[i][j]
        return n is not None and self.values[i][j] is not None and n < FEW_PAIRS

    def counts_caption(self) -> str:
        """What the caption says of the cells' counts: their range, and how the few are marked."""
        flat = [n for row in (self.counts or []) for n in row if n is not None]
        if not flat:
            return ""
        lo, hi = min(flat), max(flat)
        span = pairs(lo, self.count_unit) if lo == hi else f"{lo}–{pairs(hi, self.count_unit)}"
        text = f" Each cell averages {span} (hover a cell for its count)."
        if lo < FEW_PAIRS:
            text += (f" Cells averaged over fewer than {FEW_PAIRS} {self.count_unit}s are faded and marked with a "
                     f"dot.")
        return text


@dataclass
class Scatter:
    """Estimate against exact effect, one point per verified site of a pair."""

    key: str  # file stem of its PNG
    title: str
    points: list  # (estimate, exact effect, verify) per verified atp row
    x_label: str
    y_label: str
    groups: tuple = ("top", "random")  # verify values, in legend order
    caption: str = ""
    metric: str | None = None  # never switched by the metric buttons (atp figures are on their own metric)
    on: str = ""  # the metric both axes are on
    note: str = ""  # the correlation in a few words, under the PNG's title


def note(row, what="recovery"):
    """Hover text: the mean, its t interval (pairs as independent) and the pairs behind it."""
    if what == "recovery":
        mean, lo, hi, n = row["mean_recovery"], row["ci95_low"], row["ci95_high"], row["n_recovery"]
    else:
        mean, lo, hi, n = row["mean_effect"], row["effect_ci95_low"], row["effect_ci95_high"], row["n_pairs"]
    if mean is None:
        return f"no {what} ({row['metric']}): every pair's span is below the threshold"
    text = f"{what} ({row['metric']}) {mean:+.3f}"
    if lo is not None:
        text += f" (95% t interval {lo:+.3f} to {hi:+.3f})"
    return text + f", {pairs(n)}"


def effect_note(row):
    return note(row, "effect")


def cell_counts(rows, row_key, col_key, row_labels, col_labels, count):
    """rows laid out as grid() lays them: each cell's count (count(row)), None where there is no row."""
    index = {(r[row_key], r[col_key]): r for r in rows}
    return [[None if (a, b) not in index else count(index[(a, b)]) for b in col_labels] for a in row_labels]


def symmetric_limit(values) -> float:
    """A colour scale symmetric about zero that reaches the panel's largest magnitude."""
    flat = [abs(v) for row in values for v in row if v is not None]
    return max(flat + [1e-6])


def grid(rows, row_key, col_key, row_labels, col_labels, value, hover):
    """rows laid out by (row_key, col_key): the values and hover texts of each cell, None where none."""
    index = {(r[row_key], r[col_key]): r for r in rows}
    values = [[None if (a, b) not in index else value(index[(a, b)]) for b in col_labels] for a in row_labels]
    notes = [[None if (a, b) not in index else hover(index[(a, b)]) for b in col_labels] for a in row_labels]
    return values, notes


def roles_present(rows):
    present = {r["position_role"] for r in rows}
    return [r for r in ROLE_ORDER if r in present]


def role_order(role: str) -> int:
    return ROLE_ORDER.index(role)


def where(role: str) -> str:
    """Where a patch at position role `role` is, in words."""
    return "every position at once" if role == "all" else f"the {role.replace('_', ' ')} position"


def towards(metric: str) -> str:
    """Which way a rise of `metric` goes."""
    return " (towards the clean run's value)" if METRICS[metric].better > 0 else " (away from the clean run's value)"


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-") or "none"


def scatter_range(points) -> tuple[float, float]:
    """One range for both axes (so that y = x is the diagonal), padded by 5%."""
    values = [v for x, y, _ in points for v in (x, y)]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-9:
        lo, hi = lo - 1.0, hi + 1.0
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


@dataclass
class Curve:
    """Faithfulness against circuit size: per series (a method and ablation), its points (share of
    edges, MIB's faithfulness, and the mean of the pairs' faithfulness with its t interval)."""

    key: str  # file stem of its PNG
    title: str
    series: list  # (label, [(share, faithfulness, pair mean, low, high)]) in legend order
    x_label: str
    y_label: str
    caption: str = ""
    metric: str | None = None  # never switched by the metric buttons (on its own metric)


@dataclass
class CircuitDiagram:
    """A circuit as a graph: the input at the bottom, a row of nodes per layer (its heads, then its
    MLP), the logits at the top; its edges (sender, receiver node, mean score) drawn by score."""

    key: str  # file stem of its PNG
    title: str
    n_layers: int
    n_heads: int
    edges: list  # (sender, receiver, mean score): receiver as graph names (q.L.H, k.L.G, v.L.G, mlp_in.L, logits)
    n_kv_heads: int = 0
    caption: str = ""
    metric: str | None = None

    @property
    def limit(self) -> float:
        """The |score| the colours and widths saturate at: the 90th percentile of the drawn edges' (one
        dominant edge, as the input's into the first MLP, would fade every other)."""
        mags = sorted(abs(s) for *_, s in self.edges)
        return (mags[int(0.9 * (len(mags) - 1))] if mags else 1.0) or 1.0

    def node(self, end: str) -> list[tuple[int, int]]:
        """(row, column) of the node(s) an end names: row 0 the input, 1 + L layer L, n_layers + 1 the
        logits; columns 0..n_heads-1 the heads, n_heads the MLP. A k or v end is its group's heads."""
        if end == "input":
            return [(0, -1)]
        if end == "logits":
            return [(self.n_layers + 1, -1)]
        what, layer, *unit = end.split(".")
        row = int(layer) + 1
        if what in ("mlp_out", "mlp_in"):
            return [(row, self.n_heads)]
        u = int(unit[0])
        if what in ("head", "q"):
            return [(row, u)]
        group = self.n_heads // (self.n_kv_heads or self.n_heads)
        return [(row, h) for h in range(u * group, (u + 1) * group)]


def curve_range(c: Curve) -> tuple[tuple[float, float], tuple[float, float]]:
    """The curve's axes: log10 of the shares drawn (a decade's margin kept whole), and the
    faithfulness shown (0 to 1 at least; intervals and points beyond it, within -1 to 2)."""
    import math

    shares = [s for _, pts in c.series for s, *_ in pts if s > 0] or [0.001, 1.0]
    values = [v for _, pts in c.series for _, *vs in pts for v in vs if v is not None]
    lo, hi = min([0.0] + values), max([1.0] + values)
    return ((math.floor(math.log10(min(shares))), max(0.0, math.log10(max(shares)))),
            (max(-1.0, lo - 0.05), min(2.0, hi + 0.05)))


@dataclass
class LayerCurve:
    """A value against the layer (a linear axis), per series (a line): its points (layer, mean, and
    the mean's 95% interval, None where there is none)."""

    key: str  # file stem of its PNG
    title: str
    series: list  # (label, [(layer, mean, low, high)]) in legend order
    x_label: str
    y_label: str
    caption: str = ""
    metric: str | None = None  # never switched by the metric buttons (on its own metric)


def layer_curve_range(c: LayerCurve) -> tuple[tuple[float, float], tuple[float, float]]:
    """The curve's axes: its layers with half a layer's margin, and its means and intervals with zero,
    padded by 5%."""
    layers = [x for _, pts in c.series for x, *_ in pts] or [0]
    values = [v for _, pts in c.series for _, *vs in pts for v in vs if v is not None]
    lo, hi = min([0.0] + values), max([0.0] + values)
    if hi - lo < 1e-9:
        lo, hi = lo - 1.0, hi + 1.0
    pad = (hi - lo) * 0.05
    return (min(layers) - 0.5, max(layers) + 0.5), (lo - pad, hi + pad)


def axis_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round values from lo to hi: multiples of 1, 2 or 5 times a power of ten."""
    import math

    raw = max(hi - lo, 1e-12) / n
    power = 10 ** math.floor(math.log10(raw))
    step = next(power * m for m in (1, 2, 5, 10) if power * m >= raw)
    return [k * step for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
