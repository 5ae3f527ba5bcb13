"""The attention knockout section (Geva et al. 2023): per group of positions the last position was
blocked from reading, the relative change in p(answer) by layer with its t interval (knockout_curve),
and the layer where blocking the group lowers p the most."""
from __future__ import annotations

from . import reads as queries
from .figures import LayerCurve, pairs

METRIC = "p"  # Geva et al.'s measure, the relative change of the answer's probability (the view's on p alone)
GROUPS = {"subject": "subject", "non_subject": "non-subject", "last": "last token"}  # blocked -> label, legend order


def knockout_section(con, run_id: str, prefix: str) -> dict | None:
    """The section's figure and its table's rows (`deepest`: per group, its row of the most negative
    mean relative change); None when the run has no knockout rows on METRIC."""
    curve = [r for r in queries.knockout_curve(con, run_id) if r["metric"] == METRIC]
    if not curve:
        return None
    groups = [g for g in GROUPS if any(r["blocked"] == g for r in curve)]
    series = [(GROUPS[g], [(r["layer"], r["mean_relative_change_pct"], r["relative_change_ci95_low"],
                            r["relative_change_ci95_high"]) for r in curve if r["blocked"] == g]) for g in groups]
    n_facts, window = max(r["n_relative"] for r in curve), max(r["window"] for r in curve)
    figure = LayerCurve(f"{prefix}-relative-change",
                        f"Attention knockout: the last position blocked from each group ({METRIC}, relative change %, "
                        f"{pairs(n_facts, 'fact')}, window {window} layers)",
                        series, "layer (centre of the blocked window)", "relative change in p(answer), %",
                        caption=" Points: the mean over facts of 100 (p_knocked − p_clean) / p_clean; band: its 95% t "
                                "interval (facts as independent); dashed: no change. The window is cut at the "
                                "model's first and last layers.")
    deepest = [min((r for r in curve if r["blocked"] == g and r["mean_relative_change_pct"] is not None),
                   key=lambda r: r["mean_relative_change_pct"], default=None) for g in groups]
    return {"metric": METRIC, "curve": figure, "n_facts": n_facts, "window": window,
            "deepest": [(GROUPS[g], r) for g, r in zip(groups, deepest) if r is not None]}
