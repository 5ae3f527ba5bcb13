"""Causal tracing as Meng et al. draw it: per restored site, a token-bucket x layer heatmap of the
average indirect effect on p(answer) (the trace_buckets view), for the kinds drawn `trace_buckets`."""
from __future__ import annotations

from .figures import Heatmap, cell_counts, grid, pairs

METRIC = "p"  # Meng et al. trace on the answer's probability
PANELS = (("resid", "hidden state"), ("mlp_out", "MLP (window)"), ("attn_out", "attention (window)"))
# Meng et al.'s token buckets, top to bottom (the trace_buckets view)
BUCKETS = ("first_subject", "middle_subject", "last_subject", "first_subsequent", "further", "last")
CAPTION = ("Average indirect effect: mean p(answer) with one state restored − mean p(answer) noised, noise on the "
           "subject's embeddings; averaged over (prompt, token) in Meng et al.'s token buckets, formed as ROME's "
           "notebook forms them (a prompt's last token is also its first subsequent token when the subject ends "
           "right before it).")
WINDOW = (" Each cell restores a window of layers around its centre, clipped at the model's first and last "
          "layer.")


def bucket_note(row):
    text = f"AIE (p) {row['aie']:+.3f}"
    if row["ci95_low"] is not None:
        text += f" (95% t interval {row['ci95_low']:+.3f} to {row['ci95_high']:+.3f})"
    return text + f", {pairs(row['n_tokens'], 'token')} of {pairs(row['n_prompts'], 'prompt')}"


def bucket_figures(buckets, prefix: str) -> list[Heatmap]:
    """trace_buckets' rows on p, one panel per restored site (keys `<prefix>-<site>`), on one colour scale."""
    if not buckets:
        return []
    limit = max([abs(r["aie"]) for r in buckets if r["aie"] is not None] + [1e-6])
    order = [b for b in BUCKETS if b in {r["bucket"] for r in buckets}]
    figures = []
    for site, label in PANELS:
        rows = [r for r in buckets if r["site"] == site]
        if not rows:
            continue
        layers = sorted({r["layer"] for r in rows})
        values, notes = grid(rows, "bucket", "layer", order, layers, lambda r: r["aie"], bucket_note)
        counts = cell_counts(rows, "bucket", "layer", order, layers, lambda r: r["n_prompts"])
        axis = "layer" if site == "resid" else "window centre (layer)"
        figures.append(Heatmap(f"{prefix}-{site}", f"causal tracing: restoring the {label}, on p", order, layers,
                               values, notes, "token", axis, "AIE on p(answer)", limit,
                               caption=CAPTION + ("" if site == "resid" else WINDOW), counts=counts,
                               count_unit="prompt"))
    return figures
