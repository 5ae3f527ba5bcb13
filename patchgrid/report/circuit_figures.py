"""The circuits section's figures: the faithfulness curves (circuit_curve), the CPR and CMD table
(circuit_score), and one circuit drawn (circuit_edges): the smallest whose faithfulness reaches
DRAWN_FAITHFULNESS under the run's first ablation, else the one nearest 5% of the edges."""
from __future__ import annotations

from . import reads as queries
from .edge_matrices import METHOD_NAMES
from .figures import CircuitDiagram, Curve

DRAWN_FAITHFULNESS = 0.8
MAX_DRAWN_EDGES = 150  # a larger circuit is drawn by its first edges in the run's order


def circuit_section(con, run_id: str, prefix: str, size: float | None = None) -> dict | None:
    """The section's figures and table; `size`: the circuit drawn (percent of the edges; None: chosen)."""
    curve = queries.circuit_curve(con, run_id)
    if not curve:
        return None
    metric = curve[0]["metric"]
    series = {}
    for r in curve:
        if r["size"] == 0 or r["metric"] != metric:
            continue
        label = f"{METHOD_NAMES.get(r['method'], r['method'])}, {r['build']}, {r['ablation']}"
        series.setdefault(label, []).append((r["share"], r["faithfulness"], r["mean_pair_faithfulness"],
                                             r["pair_faithfulness_ci95_low"], r["pair_faithfulness_ci95_high"]))
    n_pairs = max(r["n_pairs"] for r in curve)
    figure = Curve(f"{prefix}-faithfulness", f"Faithfulness of circuits by size ({metric}, {n_pairs} pairs)",
                   list(series.items()), "circuit size (share of the graph's edges, log scale)",
                   "faithfulness (0: empty circuit, 1: full model)",
                   caption=" Points: MIB's faithfulness of the means over pairs; bars: the pairs' mean faithfulness "
                           "with its 95% t interval.")
    return {"metric": metric, "curve": figure, "scores": queries.circuit_score(con, run_id),
            "diagram": _diagram(con, run_id, curve, prefix, size)}


def _diagram(con, run_id: str, curve, prefix: str, size: float | None) -> CircuitDiagram | None:
    first = curve[0]["ablation"]
    sizes = sorted((r for r in curve if r["ablation"] == first and r["size"] > 0), key=lambda r: r["size"])
    if not sizes:
        return None
    good = [r for r in sizes if r["faithfulness"] is not None and r["faithfulness"] >= DRAWN_FAITHFULNESS]
    chosen = good[0] if good else min(sizes, key=lambda r: abs(r["size"] - 5.0))
    if size is not None:
        asked = [r for r in sizes if abs(r["size"] - size) < 1e-9]
        if not asked:
            raise ValueError(f"--circuit-size {size:g}: run {run_id}'s circuits have sizes "
                             f"{', '.join(format(r['size'], 'g') for r in sizes)} (percent of the edges)")
        chosen = asked[0]
    shape = queries.graph_shape(con, run_id)
    if shape is None:
        return None
    edges = queries.circuit_edges(con, run_id, chosen["size"], MAX_DRAWN_EDGES)
    cut = chosen["n_edges"] > len(edges)
    why = ("the size asked for (--circuit-size)" if size is not None else
           f"the smallest circuit whose faithfulness reaches {DRAWN_FAITHFULNESS:g}" if good else
           f"no circuit reached faithfulness {DRAWN_FAITHFULNESS:g}; the one nearest 5% of the edges")
    f = chosen["faithfulness"]
    title = (f"The circuit at {chosen['size']:g}% of the edges ({chosen['n_edges']} edges, faithfulness "
             f"{'—' if f is None else format(f, '.3f')}, {first} ablation)")
    caption = (f" {why}. Layers bottom to top (heads, then the MLP as a square); an edge into a key or value "
               "goes to every head of its key/value group; colour and width: the edge's mean score over pairs "
               "(red positive, blue negative)."
               + (f" Its first {len(edges)} edges in the run's order are drawn." if cut else ""))
    return CircuitDiagram(f"{prefix}-diagram", title, shape["n_layers"], shape["n_heads"],
                          [(e["sender"], e["receiver"], e["mean_score"] or 0.0) for e in edges],
                          n_kv_heads=shape["n_kv_heads"], caption=caption)
