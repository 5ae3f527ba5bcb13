"""Attribution patching's figures and tables, for the kinds drawn `atp`: the estimates' layer x
role and layer x head heatmaps (atp_summary), estimate against exact effect where sites were also
patched exactly, the top neurons per layer, and the agreement rows (atp_agreement). The estimates
are on each pair's headline metric, whichever metric the page shows."""
from __future__ import annotations

from collections import defaultdict

from ..metrics import METRICS
from .figures import (
    HEADLINE,
    Heatmap,
    Scatter,
    cell_counts,
    grid,
    pairs,
    role_order,
    roles_present,
    symmetric_limit,
    towards,
    where,
)

POSITION_SITES = ("resid", "attn_out", "mlp_out")  # the site kinds drawn layer x role
SITES = ("resid", "attn_out", "mlp_out", "head", "neuron")  # every site kind, in table order
TOP_NEURONS = 5  # per layer and position role
SCATTER_POINTS = 2000  # per site kind and metric; a run with more verified rows shows a sample

READING = ("AtP estimate: (clean − corrupt activation) · gradient of {metric} at the corrupt run, the "
           "linear estimate of the effect of patching the site clean into corrupt (patched − corrupt on "
           "{metric}: {meaning}), averaged over pairs. Red: the patch is estimated to raise {metric}{towards}, "
           "blue: to lower it. An estimate, not a patch: the scatter plots and the "
           "agreement table below say how close it came where sites were patched exactly. The colour scale "
           "reaches this panel's largest magnitude (legend).")


def estimate_note(row):
    """Hover text of an atp cell: the mean estimate, its t interval and pairs; the exact effect
    over the verified pairs beside their own mean estimate."""
    metric = row["metric"]
    text = f"AtP estimate ({metric}) {row['mean_estimate']:+.3f}"
    if row["estimate_ci95_low"] is not None:
        text += f" (95% t interval {row['estimate_ci95_low']:+.3f} to {row['estimate_ci95_high']:+.3f})"
    text += f", {pairs(row['n_pairs'])}"
    if row["mean_graddrop"] is not None:
        text += f"; GradDrop score ({metric}) {row['mean_graddrop']:.3f}"
    if row["n_verified"]:
        text += (f"; exact effect ({metric}) {row['mean_effect']:+.3f} over the {pairs(row['n_verified'])} patched "
                 f"exactly (their estimate {row['mean_estimate_verified']:+.3f})")
    return text


def estimate_metrics(rows):
    present = {r["metric"] for r in rows}
    return [m for m in HEADLINE if m in present] + sorted(present - set(HEADLINE))


def estimate_section(summary, agreement, verified, prefix: str) -> dict | None:
    """The attribution-patching section's figures and tables, keyed `<prefix>-...`; None without rows.

    summary: atp_summary's rows of the run; agreement: atp_agreement's; verified: the verified rows
    (queries.verified_estimates)."""
    if not summary:
        return None
    figures, scatters, neurons = [], [], []
    for metric in estimate_metrics(summary):
        rows = [r for r in summary if r["metric"] == metric]
        figures += estimate_heatmaps(rows, metric, prefix)
        scatters += estimate_scatters(verified, agreement, metric, prefix)
        neurons += top_neurons(rows, metric)
    return {"figures": figures, "scatters": scatters, "neurons": neurons, "agreement": agreement,
            "metrics": estimate_metrics(summary), "sweep": prefix}


def estimate_heatmaps(rows, metric, prefix) -> list[Heatmap]:
    """One metric's heatmaps: each position site kind layer x role, then the heads per role."""
    figures = []
    for site in POSITION_SITES:
        cell = [r for r in rows if r["site"] == site]
        if cell:
            figures.append(position_figure(cell, site, metric, prefix))
    heads = [r for r in rows if r["site"] == "head"]
    for role in roles_present(heads):
        figures.append(heads_figure([r for r in heads if r["position_role"] == role], role, metric, prefix))
    return figures


def estimate_scatters(verified, agreement, metric, prefix) -> list[Scatter]:
    scatters = []
    for site in SITES:
        points = [r for r in verified if (r["site"], r["metric"]) == (site, metric)]
        if points:
            agree = [a for a in agreement if (a["site"], a["metric"]) == (site, metric)]
            scatters.append(scatter(points, site, metric, agree, prefix))
    return scatters


def top_neurons(rows, metric) -> list[dict]:
    """Per (layer, position role), the TOP_NEURONS neurons with the largest |mean estimate|."""
    by_layer = defaultdict(list)
    for r in rows:
        if r["site"] == "neuron":
            by_layer[(r["layer"], r["position_role"])].append(r)
    out = []
    for (layer, role), cells in sorted(by_layer.items(), key=lambda k: (k[0][0], role_order(k[0][1]))):
        top = sorted(cells, key=lambda r: (-abs(r["mean_estimate"]), r["neuron"]))[:TOP_NEURONS]
        out.append({"metric": metric, "layer": layer, "position_role": role, "top": top})
    return out


def reading(metric: str) -> str:
    return READING.format(metric=metric, meaning=METRICS[metric].meaning, towards=towards(metric))


def position_figure(rows, site, metric, prefix) -> Heatmap:
    """A layer x position-role heatmap of one site kind's mean AtP estimate on `metric`."""
    layers = sorted({r["layer"] for r in rows})
    roles = roles_present(rows)
    values, notes = grid(rows, "layer", "position_role", layers, roles, lambda r: r["mean_estimate"], estimate_note)
    counts = cell_counts(rows, "layer", "position_role", layers, roles, lambda r: r["n_pairs"])
    return Heatmap(f"{prefix}-{site}-{metric}", f"AtP estimates: {site} patched clean into corrupt, on {metric}",
                   layers, roles, values, notes, "layer", "position role", f"AtP estimate ({metric})",
                   symmetric_limit(values), caption=reading(metric), extra={"on": metric}, counts=counts)


def heads_figure(rows, role, metric, prefix) -> Heatmap:
    """A layer x head heatmap of the heads' mean AtP estimate at one position role on `metric`."""
    layers = sorted({r["layer"] for r in rows})
    heads = sorted({r["head"] for r in rows})
    values, notes = grid(rows, "layer", "head", layers, heads, lambda r: r["mean_estimate"], estimate_note)
    counts = cell_counts(rows, "layer", "head", layers, heads, lambda r: r["n_pairs"])
    return Heatmap(f"{prefix}-heads-{role}-{metric}", f"AtP estimates: attention heads at {where(role)}, on {metric}",
                   layers, heads, values, notes, "layer", "head", f"AtP estimate ({metric})", symmetric_limit(values),
                   caption="Each head's output (z). " + reading(metric), extra={"on": metric}, counts=counts)


def correlations(a) -> str | None:
    """An agreement row's correlations over its random sites, with their bootstrap intervals."""
    if a["pearson_random"] is None:
        return None
    text = f"Pearson r = {a['pearson_random']:.3f}"
    if a["pearson_random_ci95_low"] is not None:
        text += f" [{a['pearson_random_ci95_low']:.3f}, {a['pearson_random_ci95_high']:.3f}]"
    if a["spearman_random"] is not None:
        text += f", Spearman ρ = {a['spearman_random']:.3f}"
        if a["spearman_random_ci95_low"] is not None:
            text += f" [{a['spearman_random_ci95_low']:.3f}, {a['spearman_random_ci95_high']:.3f}]"
    return f"{text} over {a['n_random_verified']} random sites of {pairs(a['n_pairs_random'])} ({a['scope']})"


def scatter(rows, site, metric, agree, prefix) -> Scatter:
    """Estimate against exact effect of the verified sites of one site kind on `metric`; `agree`: the
    kind's agreement rows on it, one per scope."""
    points = [(r["estimate"], r["effect"], r["verify"]) for r in rows]
    n_rows = rows[0]["n_rows"]
    shown = "" if n_rows == len(points) else \
        f" {len(points)} of the {n_rows} verified sites are shown (a fixed sample)."
    found = [c for c in map(correlations, agree) if c is not None]
    note = found[0] if found else ""
    corr = (f"Correlation of estimate and exact effect on {metric} over the random sites alone (unbiased for the "
            f"sites outside the top K; 95% bootstrap intervals over pairs; atp_agreement): {'; '.join(found)}."
            if found else "Correlation over the random sites: none (fewer than two sites, or no spread).")
    ranked = "GradDrop score" if any(a["ranked_by"] == "graddrop" for a in agree) else "|estimate|"
    caption = (f"Each point is one site of one pair patched exactly: its AtP estimate against its exact effect "
               f"(patched − corrupt on {metric}). Red: among the pair's top K by {ranked}; blue: sampled at "
               f"random from the rest. On the dashed line y = x the estimate is exact. {corr}{shown}")
    return Scatter(f"{prefix}-scatter-{site}-{metric}", f"AtP estimate against exact patching: {site}, on {metric}",
                   points, f"AtP estimate ({metric})", f"exact effect ({metric})", caption=caption, on=metric,
                   note=note)
