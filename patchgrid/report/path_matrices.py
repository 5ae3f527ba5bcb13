"""Path patching's matrices: per metric and position role, a sender x receiver heatmap of each
path's mean effect (the path_summary view), for the kinds drawn `paths`."""
from __future__ import annotations

from ..metrics import METRICS
from .figures import Heatmap, cell_counts, effect_note, grid, pairs, roles_present, symmetric_limit, towards, where

# A matrix shows at most this many senders and receivers, those with the largest |mean effect| in
# any of their cells
PATH_TOP = 40
PATH_SENDER_SITES = ("head", "attn_out", "mlp_out")  # a layer's senders in this order


def sender_order(row):
    """Senders by layer; within a layer its heads (by head), then attn_out, then mlp_out."""
    site = row["sender_site"]
    return (row["sender_layer"], PATH_SENDER_SITES.index(site) if site in PATH_SENDER_SITES else 9,
            -1 if row["sender_head"] is None else row["sender_head"], row["sender"])


def receiver_order(row):
    """The logits first, then later heads' inputs by layer, head and input (q, k, v)."""
    if row["receiver_input"] is None:
        return (0, 0, 0, 0, row["receiver"])
    return (1, row["receiver_layer"], row["receiver_head"], "qkv".find(row["receiver_input"]), row["receiver"])


def top_ends(rows, key, order, limit):
    """The `limit` ends (senders or receivers) with the largest |mean effect| in any of their cells,
    in `order`; and how many there were."""
    largest = {}
    for r in rows:
        v = abs(r["mean_effect"]) if r["mean_effect"] is not None else -1.0
        largest[r[key]] = max(largest.get(r[key], -1.0), v)
    kept = set(sorted(largest, key=lambda e: (-largest[e], e))[:limit])
    first = {}
    for r in sorted(rows, key=order):
        if r[key] in kept:
            first.setdefault(r[key], r)
    return list(first), len(largest)


def path_note(row):
    text = effect_note(row)
    if row["mean_recovery"] is not None:
        text += f"; recovery ({row['metric']}) {row['mean_recovery']:+.3f} over {pairs(row['n_recovery'])}"
    return text


MLPS_CAPTIONS = {
    "frozen": "MLPs frozen at their corrupt values: direct paths only (the sender's change reaches the "
              "receiver through the residual stream, through no later attention or MLP).",
    "recomputed": "MLPs recomputed (Wang et al.'s freeze-and-patch: every later attention output frozen at its "
                  "corrupt value, the MLPs recompute), so paths through MLPs count too.",
}


def mlps_caption(params: dict) -> str:
    mlps = params.get("path_mlps")
    return MLPS_CAPTIONS.get(mlps, "How the MLPs were treated (path_mlps) is not recorded in the run's params.")


def path_section(summary, metrics, params: dict, prefix: str) -> dict | None:
    """The path-patching section's matrices (path_summary's rows): per metric (the page's order) and
    position role, senders x receivers, keyed `<prefix>-<role>-<metric>`; None without rows."""
    if not summary:
        return None
    figures = []
    for metric in [m for m in metrics if any(r["metric"] == m for r in summary)]:
        on = [r for r in summary if r["metric"] == metric]
        for role in roles_present(on):
            figures.append(path_figure([r for r in on if r["position_role"] == role], role, metric, params, prefix))
    return {"figures": figures, "mlps": mlps_caption(params), "params": params, "sweep": prefix}


def path_figure(rows, role, metric, params, prefix: str) -> Heatmap:
    """A sender x receiver heatmap of the paths' mean effect at one position role on one metric."""
    senders, n_senders = top_ends(rows, "sender", sender_order, PATH_TOP)
    receivers, n_receivers = top_ends(rows, "receiver", receiver_order, PATH_TOP)
    values, notes = grid(rows, "sender", "receiver", senders, receivers, lambda r: r["mean_effect"], path_note)
    counts = cell_counts(rows, "sender", "receiver", senders, receivers, lambda r: r["n_pairs"])
    found = sorted({r["n_pairs"] for r in rows})
    n = pairs(found[0]) if len(found) == 1 else f"{found[0]}–{pairs(found[-1])}"
    at = where(role)
    spec = METRICS[metric]
    shown = ""
    if n_senders > len(senders) or n_receivers > len(receivers):
        shown = (f" Shown: the {len(senders)} of {n_senders} senders and the {len(receivers)} of {n_receivers} "
                 f"receivers with the largest |mean effect| in any of their cells.")
    caption = (f"Each cell: the sender (row: a head's output, or a layer's attn_out or mlp_out) patched clean into "
               f"corrupt along one path only, to the receiver (column: logits, the direct effect; or a later "
               f"head's query, key or value input, k and v by key/value head), at {at}: the mean over pairs of "
               f"patched − corrupt on {metric} ({spec.meaning}); {n} per cell. Red: the path raises "
               f"{metric}{towards(metric)}, blue: lowers it. {mlps_caption(params)} The colour scale reaches this "
               f"panel's largest magnitude (legend).{shown}")
    return Heatmap(f"{prefix}-{role}-{metric}", f"path patching, sender → receiver at {at} ({n}), on {metric}",
                   senders, receivers, values, notes, "sender", "receiver", f"mean effect ({metric})",
                   symmetric_limit(values), caption=caption, metric=metric, counts=counts)
