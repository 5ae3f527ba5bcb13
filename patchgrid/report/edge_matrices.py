"""Edge attribution's matrix: per position role, a sender x receiver heatmap of the edges with the
largest mean |score| (the edge_summary view), for the kinds drawn `edges`."""
from __future__ import annotations

from .figures import Heatmap, cell_counts, grid, pairs, roles_present, symmetric_limit, where
from .path_matrices import PATH_TOP, sender_order, top_ends

METHOD_NAMES = {"eap": "EAP (Syed et al. 2023)", "eap-ig": "EAP-IG (Hanna et al. 2024)"}


INPUTS = ("q", "k", "v", "mlp_in", "logits")  # a layer's receivers in this order (graph.EdgeGraph.receivers)


def edge_sender_order(row):
    """The input first, then by layer its heads (by head) and its MLP."""
    if row["sender"] == "input":
        return (-1, 0, -1, row["sender"])
    return sender_order(row)


def receiver_order(row):
    """Receivers by layer (the logits last); within a layer the heads' q, k, v by head, then the MLP."""
    layer = row["receiver_layer"]
    return (10**9 if layer is None else layer, INPUTS.index(row["receiver_input"]),
            -1 if row["receiver_head"] is None else row["receiver_head"], row["receiver"])


def edge_note(row) -> str:
    text = f"score ({row['metric']}) {row['mean_score']:+.3f}"
    if row["score_ci95_low"] is not None:
        text += f" (95% t interval {row['score_ci95_low']:+.3f} to {row['score_ci95_high']:+.3f})"
    return text + f", {pairs(row['n_pairs'])}"


def edge_section(summary, prefix: str) -> dict | None:
    """The edges section's matrices (edge_summary's rows), one per position role, keyed
    `<prefix>-<role>`; None without rows."""
    if not summary:
        return None
    # top_ends ranks ends by |mean_effect|: here the mean score
    rows = [{**r, "mean_effect": r["mean_score"]} for r in summary]
    first = summary[0]
    method = METHOD_NAMES.get(first["method"], first["method"] or "a method the run did not record")
    steps = f", {first['ig_steps']} steps" if first["ig_steps"] else ""
    figures = [edge_figure([r for r in rows if r["position_role"] == role], role, f"{method}{steps}", prefix)
               for role in roles_present(rows)]
    return {"figures": figures, "method": f"{method}{steps}", "sweep": prefix, "n_edges": len({
        (r["sender"], r["receiver"]) for r in summary})}


def edge_figure(rows, role, method: str, prefix: str) -> Heatmap:
    senders, n_senders = top_ends(rows, "sender", edge_sender_order, PATH_TOP)
    receivers, n_receivers = top_ends(rows, "receiver", receiver_order, PATH_TOP)
    values, notes = grid(rows, "sender", "receiver", senders, receivers, lambda r: r["mean_score"], edge_note)
    counts = cell_counts(rows, "sender", "receiver", senders, receivers, lambda r: r["n_pairs"])
    metric = rows[0]["metric"]
    found = sorted({r["n_pairs"] for r in rows})
    n = pairs(found[0]) if len(found) == 1 else f"{found[0]}–{pairs(found[-1])}"
    at = "summed over the prompt's positions" if role == "all" else f"at {where(role)}"
    caption = (f"Each cell: an edge's attribution score by {method}, {at}: the first-order estimate of patched − "
               f"corrupt on {metric} when that edge alone carries the clean sender's output into the corrupt run "
               f"(row: the sender, the input, a head or an MLP; column: the receiver's input, a later head's query, "
               f"key or value (k and v by key/value head), an MLP's input or the logits); the mean over {n}. "
               f"Red: the edge raises {metric}, blue: lowers it. Shown: the {len(senders)} of {n_senders} senders "
               f"and the {len(receivers)} of {n_receivers} receivers with the largest |mean score| in any of their "
               f"cells; an empty cell is no edge, or one not among them. Estimates, not patched runs.")
    return Heatmap(f"{prefix}-{role}", f"edge scores, sender → receiver {at} ({n}), on {metric}",
                   senders, receivers, values, notes, "sender", "receiver", f"mean score ({metric})",
                   symmetric_limit(values), caption=caption, metric=None, counts=counts)
