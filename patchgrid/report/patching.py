"""Exact patching's heatmaps: a layer x position-role panel per (sweep, site, direction) of the
kinds drawn `layer_by_role`, a layer x head panel per position role and site of the kinds drawn
`layer_by_head`, each once per metric; and the small multiples by relation."""
from __future__ import annotations

from ..metrics import METRICS
from ..model.sites import SITE_KINDS
from .figures import (
    Heatmap,
    cell_counts,
    effect_note,
    grid,
    note,
    pairs,
    roles_present,
    slug,
    symmetric_limit,
    where,
)

# The labels of a head's sites other than its output (z): its query, key and value
QKV_SITES = {"q": "query (q)", "k": "key (k)", "v": "value (v)"}


def position_figures(summary, sweeps, metrics) -> list[Heatmap]:
    """effect_summary's rows of `sweeps` (in that order) as layer x role panels, metric by metric."""
    order = {sweep: k for k, sweep in enumerate(sweeps)}
    groups = sorted({(r["sweep"], r["site"], r["direction"]) for r in summary if r["sweep"] in order},
                    key=lambda g: (order[g[0]], g))
    figures = []
    for metric in metrics:
        for sweep, site, direction in groups:
            rows = [r for r in summary if (r["sweep"], r["site"], r["direction"], r["metric"])
                    == (sweep, site, direction, metric)]
            if rows:
                figures.append(patching_figure(rows, sweep, site, direction, metric))
    return figures


def head_figures(summary, sweeps, metrics) -> list[Heatmap]:
    """effect_summary's rows of `sweeps` (in that order) as layer x head panels, metric by metric:
    per sweep, position role and site."""
    figures = []
    for metric in metrics:
        for sweep in sweeps:
            of_sweep = [r for r in summary if r["sweep"] == sweep and r["metric"] == metric]
            sites = [s for s in SITE_KINDS if any(r["site"] == s for r in of_sweep)]
            for role in roles_present(of_sweep):
                for site in sites:
                    rows = [r for r in of_sweep if r["position_role"] == role and r["site"] == site]
                    if rows:
                        figures.append(heads_figure(rows, sweep, role, metric, site))
    return figures


def relation_multiples(by_relation, headline) -> list[Heatmap]:
    """One small layer x role panel of mean recovery per relation, on the headline metric, each with
    its own colour bar; its title gives the relation's pairs."""
    multiples = []
    by_relation = [r for r in by_relation if r["metric"] == headline]
    for relation in sorted({r["relation"] for r in by_relation if r["relation"] is not None}):
        rows = [r for r in by_relation if r["relation"] == relation]
        layers = sorted({r["layer"] for r in rows})
        roles = roles_present(rows)
        values, notes = grid(rows, "layer", "position_role", layers, roles, lambda r: r["mean_recovery"], note)
        counts = cell_counts(rows, "layer", "position_role", layers, roles, lambda r: r["n_recovery"])
        n = max(r["n_pairs"] for r in rows)
        multiples.append(Heatmap(f"relation-{slug(relation)}", f"{relation} ({pairs(n)}, {headline})", layers, roles,
                                 values, notes, "layer", "position role", f"mean recovery ({headline})", 1.0,
                                 caption=f"Recovery on {headline} of the pairs of relation {relation}, patched clean "
                                         f"into corrupt, averaged over them.",
                                 small=True, counts=counts))
    return multiples


def direction_words(metric: str) -> str:
    """How to read a metric whose clean value is the smaller (kl, logp_corrupt, rank)."""
    if metric == "kl":
        return (" KL is 0 for the clean run and lower is closer to clean, so recovery = 1 − KL(patched) / "
                "KL(corrupt).")
    if METRICS[metric].better < 0:
        return f" On {metric} lower is closer to clean; recovery is 1 at the clean run's value all the same."
    return ""


def patching_figure(rows, sweep, site, direction, metric) -> Heatmap:
    """A layer x position-role heatmap of one sweep, site and direction on one metric."""
    layers = sorted({r["layer"] for r in rows}, key=lambda layer: -1 if layer is None else layer)
    roles = roles_present(rows)
    what = "clean into corrupt" if direction == "denoise" else "corrupt into clean"
    meaning = METRICS[metric].meaning
    if METRICS[metric].min_span is None:
        # no recovery (a ratio of ranks means nothing): the mean effect itself, on its own scale
        values, notes = grid(rows, "layer", "position_role", layers, roles, lambda r: r["mean_effect"],
                             effect_note)
        counts = cell_counts(rows, "layer", "position_role", layers, roles, lambda r: r["n_pairs"])
        units = f"mean effect ({metric})"
        reference = "corrupt" if direction == "denoise" else "clean"
        reading = (f"Mean effect on {metric} ({meaning}): patched − {reference}, averaged over pairs; it has no "
                   f"recovery. Rank 0 is the top token, so in denoising blue (below 0) means the patch brings "
                   f"the clean answer up, in noising red (above 0) means it pushes the clean answer down. The "
                   f"colour scale reaches this panel's largest magnitude (legend).")
        limit = symmetric_limit(values)
    else:
        if direction == "denoise":
            value = lambda r: r["mean_recovery"]
            units = f"mean recovery ({metric})"
            reading = (f"Recovery = (patched − corrupt) / (clean − corrupt) on {metric} ({meaning}), averaged over "
                       f"pairs. Red, 1: the patch alone restores the clean run's value; 0: it does nothing.")
        else:
            # patching corrupt into clean: a recovery of 1 means the site changed nothing, so the
            # picture shows what the patch took away, with important sites red as in denoising
            value = lambda r: None if r["mean_recovery"] is None else 1 - r["mean_recovery"]
            units = f"1 − mean recovery ({metric})"
            reading = (f"1 − recovery on {metric} ({meaning}): the share of the clean run's lead over the corrupt "
                       f"run that the patch takes away, averaged over pairs. Red, 1: the site carries the whole "
                       f"answer (patching it alone makes the run corrupt); 0: the answer does not depend on it.")
        values, notes = grid(rows, "layer", "position_role", layers, roles, value, note)
        counts = cell_counts(rows, "layer", "position_role", layers, roles, lambda r: r["n_recovery"])
        reading += direction_words(metric) + (" Pairs whose clean − corrupt span is below the threshold are left "
                                              "out (see n_small_span).")
        limit = 1.0
    layers = ["embedding" if layer is None else layer for layer in layers]  # the embed sweep has no layer
    return Heatmap(f"{sweep}-{direction}-{metric}", f"{site} patching, {direction} ({what}), on {metric}", layers,
                   roles, values, notes, "layer", "position role", units, limit, caption=reading, metric=metric,
                   counts=counts)


def heads_figure(rows, sweep, role, metric, site="head") -> Heatmap:
    """A layer x head heatmap at one position role on one metric, scaled to its largest magnitude:
    the heads' outputs (z), or with `site` q, k or v their query, key or value. Its key: the sweep,
    the site unless it is the heads' output, the role and the metric."""
    layers = sorted({r["layer"] for r in rows})
    n_heads = sorted({r["head"] for r in rows})
    if METRICS[metric].min_span is None:
        values, notes = grid(rows, "layer", "head", layers, n_heads, lambda r: r["mean_effect"],
                             effect_note)
        counts = cell_counts(rows, "layer", "head", layers, n_heads, lambda r: r["n_pairs"])
        units, shown = f"mean effect ({metric})", f"the mean effect on {metric} (patched − corrupt; no recovery)"
    else:
        values, notes = grid(rows, "layer", "head", layers, n_heads, lambda r: r["mean_recovery"], note)
        counts = cell_counts(rows, "layer", "head", layers, n_heads, lambda r: r["n_recovery"])
        units, shown = f"mean recovery ({metric})", f"recovery on {metric}"
    at = where(role)
    if site == "head":
        key, title, what, axis = (f"{sweep}-{role}-{metric}", f"attention heads patched at {at}, on {metric}",
                                  "Each head's output (z)", "head")
    else:
        label = QKV_SITES[site]
        key, title = f"{sweep}-{site}-{role}-{metric}", f"attention heads' {label} patched at {at}, on {metric}"
        what = f"Each head's {label}" + (" (k and v: per key/value head)" if site != "q" else "")
        axis = "head" if site == "q" else "key/value head"
    return Heatmap(key, title, layers, n_heads,
                   values, notes, "layer", axis, units, symmetric_limit(values),
                   caption=f"{what} patched clean into corrupt; {shown} ({METRICS[metric].meaning})."
                           + direction_words(metric) + " The colour scale reaches this panel's largest magnitude "
                           "(legend), so small head effects show.", metric=metric, counts=counts)

