"""A study's pictures: one self-contained HTML page and a PNG of each figure, from the warehouse's views.

The page has its styles, data and figures (inline SVG) inside it and makes no network request.
Every heatmap's colour scale is centred at zero, its axes are labelled with layer numbers and role
names, and each cell's hover text gives the mean, its metric, its 95% interval and the pair count.

The patching and head heatmaps are drawn once per metric the run has (`patchgrid.metrics`), and
the page shows one metric at a time: a row of radio buttons selects it with CSS alone (no script),
the headline metric (logprob_diff, else logit_diff for older loads) first. Causal tracing is drawn on p(answer), as
Meng et al. trace, and the small multiples by relation on the headline metric.

The resid, resid_pre, resid_mid, attn_out and mlp_out sweeps are drawn layer x position role;
heads, and the qkv sweep's q, k and v (one panel each), layer x head per position role.

A run with path-patching rows (sweep `paths`) has a section of its own (they are in no other):
per metric and position role, a sender x receiver matrix of the mean effect of each path
(path_summary), its caption saying whether the MLPs were frozen (direct paths) or recomputed (the
run's path_mlps). A run without paths rows has no such section.

A run with attribution-patching rows (sweep `atp`) has a section of its own, on the metric its
estimates are on (each pair's headline metric) whichever metric is selected: the estimates' layer
x role and layer x head heatmaps (atp_summary), estimate-against-exact scatter plots of the sites
also patched exactly, the top neurons per layer, and the agreement numbers (atp_agreement). A run
without atp rows has no such section.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path

from .metrics import METRICS
from .rows import POSITION_ROLES as ROLE_ORDER

TRACE_PANELS = (("resid", "hidden state"), ("mlp_out", "MLP (window)"), ("attn_out", "attention (window)"))
# Meng et al.'s token buckets, top to bottom (the trace_buckets view)
TRACE_BUCKETS = ("first_subject", "middle_subject", "last_subject", "first_subsequent", "further", "last")
# The metric shown first (and the only one for the small multiples): the first of these the run has.
# logprob_diff: every pair has it (answers of any length), and for one-token answers it equals logit_diff
HEADLINE = ("logprob_diff", "logit_diff")
# Attribution patching: the site kinds drawn layer x role, and every site kind in table order
ATP_POSITION_SITES = ("resid", "attn_out", "mlp_out")
ATP_SITES = ("resid", "attn_out", "mlp_out", "head", "neuron")
ATP_TOP_NEURONS = 5  # per layer and position role
# Sweeps drawn layer x position role, in this order (others after them, by name); the sweeps drawn
# otherwise: heads and qkv layer x head, neurons not at all (a cell per neuron), trace by bucket,
# paths in their own section
POSITION_SWEEPS = ("resid", "resid_pre", "resid_mid", "attn_out", "mlp_out")
NOT_LAYER_BY_ROLE = ("heads", "neurons", "trace", "qkv", "paths")
QKV_SITES = {"q": "query (q)", "k": "key (k)", "v": "value (v)"}
# Path patching: a matrix shows at most this many senders and receivers, those with the largest
# |mean effect| in any of their cells
PATH_TOP = 40
PATH_SENDER_SITES = ("head", "attn_out", "mlp_out")  # a layer's senders in this order
ATP_SCATTER_POINTS = 2000  # per site kind and metric; a run with more verified rows shows a sample


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


def _q(con, sql, params=()):
    cur = con.execute(sql, list(params))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def _note(row, what="recovery"):
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
    return text + f", {n} pairs"


def _bucket_note(row):
    text = f"AIE (p) {row['aie']:+.3f}"
    if row["ci95_low"] is not None:
        text += f" (95% t interval {row['ci95_low']:+.3f} to {row['ci95_high']:+.3f})"
    return text + f", {row['n_tokens']} tokens of {row['n_prompts']} prompts"


def _symmetric_limit(values) -> float:
    """A colour scale symmetric about zero that reaches the panel's largest magnitude."""
    flat = [abs(v) for row in values for v in row if v is not None]
    return max(flat + [1e-6])


def _grid(rows, row_key, col_key, row_labels, col_labels, value, note):
    index = {(r[row_key], r[col_key]): r for r in rows}
    values = [[None if (a, b) not in index else value(index[(a, b)]) for b in col_labels] for a in row_labels]
    notes = [[None if (a, b) not in index else note(index[(a, b)]) for b in col_labels] for a in row_labels]
    return values, notes


def _roles_present(rows):
    present = {r["position_role"] for r in rows}
    return [r for r in ROLE_ORDER if r in present]


def collect(con, run_id: str) -> dict:
    """Everything the page shows, read from the views only."""
    info = _q(con, "SELECT * FROM run_overview WHERE run_id = ?", [run_id])
    if not info:
        raise ValueError(f"run {run_id!r} is not in the warehouse")
    summary = _q(con, "SELECT * FROM effect_summary WHERE run_id = ?", [run_id])
    by_relation = _q(con, "SELECT * FROM relation_summary WHERE run_id = ? AND sweep = 'resid' AND direction = "
                          "'denoise'", [run_id])
    rejections = _q(con, "SELECT reason, n FROM rejections WHERE run_id = ? ORDER BY n DESC", [run_id])
    present = {r["metric"] for r in summary}
    metrics = [m for m in METRICS if m in present]
    headline = next((m for m in HEADLINE if m in present), metrics[0] if metrics else None)
    metrics = [headline] + [m for m in metrics if m != headline] if headline else []
    figures: list[Heatmap] = []
    # heads and qkv have their own figures; exhaustive neuron sweeps have a cell per neuron, which a
    # layer x role heatmap cannot hold; paths have a section of their own
    groups = sorted({(r["sweep"], r["site"], r["direction"]) for r in summary
                     if r["sweep"] not in NOT_LAYER_BY_ROLE},
                    key=lambda g: (POSITION_SWEEPS.index(g[0]) if g[0] in POSITION_SWEEPS else 9, g))
    for metric in metrics:
        for sweep, site, direction in groups:
            rows = [r for r in summary if (r["sweep"], r["site"], r["direction"], r["metric"])
                    == (sweep, site, direction, metric)]
            if rows:
                figures.append(_patching_figure(rows, sweep, site, direction, metric))
        heads = [r for r in summary if r["sweep"] == "heads" and r["metric"] == metric]
        for role in _roles_present(heads):
            figures.append(_heads_figure([r for r in heads if r["position_role"] == role], role, metric))
        qkv = [r for r in summary if r["sweep"] == "qkv" and r["metric"] == metric]
        for role in _roles_present(qkv):
            for site in QKV_SITES:
                rows = [r for r in qkv if r["position_role"] == role and r["site"] == site]
                if rows:
                    figures.append(_heads_figure(rows, role, metric, site))
    buckets = _q(con, "SELECT * FROM trace_buckets WHERE run_id = ? AND metric = 'p'", [run_id])
    if buckets:
        limit = max([abs(r["aie"]) for r in buckets if r["aie"] is not None] + [1e-6])
        order = [b for b in TRACE_BUCKETS if b in {r["bucket"] for r in buckets}]
        for site, label in TRACE_PANELS:
            rows = [r for r in buckets if r["site"] == site]
            if not rows:
                continue
            layers = sorted({r["layer"] for r in rows})
            values, notes = _grid(rows, "bucket", "layer", order, layers, lambda r: r["aie"], _bucket_note)
            axis = "layer" if site == "resid" else "window centre (layer)"
            figures.append(Heatmap(f"trace-{site}", f"causal tracing: restoring the {label}, on p", order, layers,
                                   values,
                                   notes, "token", axis, "AIE on p(answer)", limit,
                                   caption="Average indirect effect: mean p(answer) with one state restored − mean "
                                           "p(answer) noised, noise on the subject's embeddings; averaged over "
                                           "(prompt, token) in Meng et al.'s token buckets."
                                           + ("" if site == "resid" else " Each cell restores a window of layers "
                                              "around its centre, clipped at the model's first and last layer.")))
    multiples = []
    by_relation = [r for r in by_relation if r["metric"] == headline]
    for relation in sorted({r["relation"] for r in by_relation if r["relation"] is not None}):
        rows = [r for r in by_relation if r["relation"] == relation]
        layers = sorted({r["layer"] for r in rows})
        roles = _roles_present(rows)
        values, notes = _grid(rows, "layer", "position_role", layers, roles, lambda r: r["mean_recovery"], _note)
        n = max(r["n_pairs"] for r in rows)
        multiples.append(Heatmap(f"relation-{_slug(relation)}", f"{relation} ({n} pairs, {headline})", layers, roles,
                                 values, notes, "layer", "position role", f"mean recovery ({headline})", 1.0,
                                 small=True))
    return {"info": info[0], "figures": figures, "multiples": multiples, "rejections": rejections,
            "metrics": metrics, "headline": headline, "atp": _collect_atp(con, run_id),
            "paths": _collect_paths(con, run_id, metrics, _params(info[0]["params"]))}


def _params(params) -> dict:
    """The run's params (runs.params, JSON) as a dict."""
    try:
        params = json.loads(params) if isinstance(params, str) else (params or {})
    except ValueError:
        params = {"params": params}
    return params if isinstance(params, dict) else {"params": params}


def _sender_order(row):
    """Senders by layer; within a layer its heads (by head), then attn_out, then mlp_out."""
    site = row["sender_site"]
    return (row["sender_layer"], PATH_SENDER_SITES.index(site) if site in PATH_SENDER_SITES else 9,
            -1 if row["sender_head"] is None else row["sender_head"], row["sender"])


def _receiver_order(row):
    """The logits first, then later heads' inputs by layer, head and input (q, k, v)."""
    if row["receiver_input"] is None:
        return (0, 0, 0, 0, row["receiver"])
    return (1, row["receiver_layer"], row["receiver_head"], "qkv".find(row["receiver_input"]), row["receiver"])


def _top(rows, key, order, limit):
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


def _path_note(row):
    text = _note(row, "effect")
    if row["mean_recovery"] is not None:
        text += f"; recovery ({row['metric']}) {row['mean_recovery']:+.3f} over {row['n_recovery']} pairs"
    return text


_PATH_MLPS = {
    "frozen": "MLPs frozen at their corrupt values: direct paths only (the sender's change reaches the "
              "receiver through the residual stream, through no later attention or MLP).",
    "recomputed": "MLPs recomputed (Wang et al.'s freeze-and-patch: every later attention output frozen at its "
                  "corrupt value, the MLPs recompute), so paths through MLPs count too.",
}


def _path_mlps(params: dict) -> str:
    mlps = params.get("path_mlps")
    return _PATH_MLPS.get(mlps, "How the MLPs were treated (path_mlps) is not recorded in the run's params.")


def _collect_paths(con, run_id: str, metrics, params: dict) -> dict | None:
    """The path-patching section's matrices (path_summary): per metric (the page's order) and position
    role, senders x receivers; None when the run has no paths rows."""
    summary = _q(con, "SELECT * FROM path_summary WHERE run_id = ?", [run_id])
    if not summary:
        return None
    figures = []
    for metric in [m for m in metrics if any(r["metric"] == m for r in summary)]:
        on = [r for r in summary if r["metric"] == metric]
        for role in _roles_present(on):
            figures.append(_path_figure([r for r in on if r["position_role"] == role], role, metric, params))
    return {"figures": figures, "mlps": _path_mlps(params), "params": params}


def _path_figure(rows, role, metric, params) -> Heatmap:
    """A sender x receiver heatmap of the paths' mean effect at one position role on one metric."""
    senders, n_senders = _top(rows, "sender", _sender_order, PATH_TOP)
    receivers, n_receivers = _top(rows, "receiver", _receiver_order, PATH_TOP)
    values, notes = _grid(rows, "sender", "receiver", senders, receivers, lambda r: r["mean_effect"], _path_note)
    pairs = sorted({r["n_pairs"] for r in rows})
    n = f"{pairs[0]}" if len(pairs) == 1 else f"{pairs[0]}–{pairs[-1]}"
    where = "every position at once" if role == "all" else f"the {role.replace('_', ' ')} position"
    spec = METRICS[metric]
    towards = " (towards the clean run's value)" if spec.better > 0 else " (away from the clean run's value)"
    shown = ""
    if n_senders > len(senders) or n_receivers > len(receivers):
        shown = (f" Shown: the {len(senders)} of {n_senders} senders and the {len(receivers)} of {n_receivers} "
                 f"receivers with the largest |mean effect| in any of their cells.")
    caption = (f"Each cell: the sender (row: a head's output, or a layer's attn_out or mlp_out) patched clean into "
               f"corrupt along one path only, to the receiver (column: logits, the direct effect; or a later "
               f"head's query, key or value input, k and v by key/value head), at {where}: the mean over pairs of "
               f"patched − corrupt on {metric} ({spec.meaning}); {n} pairs per cell. Red: the path raises "
               f"{metric}{towards}, blue: lowers it. {_path_mlps(params)} The colour scale reaches this panel's "
               f"largest magnitude (legend).{shown}")
    return Heatmap(f"paths-{role}-{metric}", f"path patching, sender → receiver at {where} ({n} pairs), on {metric}",
                   senders, receivers, values, notes, "sender", "receiver", f"mean effect ({metric})",
                   _symmetric_limit(values), caption=caption, metric=metric)


def _atp_note(row):
    """Hover text of an atp cell: the mean estimate, its t interval and pairs; the exact effect
    over the verified pairs beside their own mean estimate."""
    metric = row["metric"]
    text = f"AtP estimate ({metric}) {row['mean_estimate']:+.3f}"
    if row["estimate_ci95_low"] is not None:
        text += f" (95% t interval {row['estimate_ci95_low']:+.3f} to {row['estimate_ci95_high']:+.3f})"
    text += f", {row['n_pairs']} pairs"
    if row["mean_graddrop"] is not None:
        text += f"; GradDrop score ({metric}) {row['mean_graddrop']:.3f}"
    if row["n_verified"]:
        text += (f"; exact effect ({metric}) {row['mean_effect']:+.3f} over the {row['n_verified']} pairs patched "
                 f"exactly (their estimate {row['mean_estimate_verified']:+.3f})")
    return text


def _atp_metrics(rows):
    present = {r["metric"] for r in rows}
    return [m for m in HEADLINE if m in present] + sorted(present - set(HEADLINE))


def _collect_atp(con, run_id: str) -> dict | None:
    """The attribution-patching section's figures and tables; None when the run has no atp rows."""
    summary = _q(con, "SELECT * FROM atp_summary WHERE run_id = ?", [run_id])
    if not summary:
        return None
    agreement = _q(con, "SELECT * FROM atp_agreement WHERE run_id = ? ORDER BY list_position(?, site), metric",
                   [run_id, list(ATP_SITES)])
    # the verified rows, a deterministic sample of ATP_SCATTER_POINTS per site kind and metric at most
    verified = _q(con, """
        SELECT site, metric, verify, estimate, effect, n_rows FROM (
            SELECT site, metric, verify, estimate::DOUBLE AS estimate, effect::DOUBLE AS effect,
                   count(*) OVER (PARTITION BY site, metric) AS n_rows,
                   row_number() OVER (PARTITION BY site, metric
                                      ORDER BY hash(pair_id, layer, position, head, neuron)) AS k
            FROM effects WHERE run_id = ? AND sweep = 'atp' AND verify IS NOT NULL
              AND effect IS NOT NULL AND estimate IS NOT NULL)
        WHERE k <= ? ORDER BY site, metric, verify DESC, k""", [run_id, ATP_SCATTER_POINTS])
    figures, scatters, neurons = [], [], []
    for metric in _atp_metrics(summary):
        rows = [r for r in summary if r["metric"] == metric]
        for site in ATP_POSITION_SITES:
            cell = [r for r in rows if r["site"] == site]
            if cell:
                figures.append(_atp_position_figure(cell, site, metric))
        heads = [r for r in rows if r["site"] == "head"]
        for role in _roles_present(heads):
            figures.append(_atp_heads_figure([r for r in heads if r["position_role"] == role], role, metric))
        for site in ATP_SITES:
            points = [r for r in verified if (r["site"], r["metric"]) == (site, metric)]
            if points:
                agree = next((a for a in agreement if (a["site"], a["metric"]) == (site, metric)), None)
                scatters.append(_atp_scatter(points, site, metric, agree))
        by_layer = {}
        for r in rows:
            if r["site"] == "neuron":
                by_layer.setdefault((r["layer"], r["position_role"]), []).append(r)
        for (layer, role), cells in sorted(by_layer.items(), key=lambda k: (k[0][0], ROLE_ORDER.index(k[0][1]))):
            top = sorted(cells, key=lambda r: (-abs(r["mean_estimate"]), r["neuron"]))[:ATP_TOP_NEURONS]
            neurons.append({"metric": metric, "layer": layer, "position_role": role, "top": top})
    return {"figures": figures, "scatters": scatters, "neurons": neurons, "agreement": agreement,
            "metrics": _atp_metrics(summary)}


_ATP_READING = ("AtP estimate: (clean − corrupt activation) · gradient of {metric} at the corrupt run, the "
                "linear estimate of the effect of patching the site clean into corrupt (patched − corrupt on "
                "{metric}: {meaning}), averaged over pairs. Red: the patch is estimated to raise {metric}{towards}, "
                "blue: to lower it. An estimate, not a patch: the scatter plots and the "
                "agreement table below say how close it came where sites were patched exactly. The colour scale "
                "reaches this panel's largest magnitude (legend).")


def _atp_reading(metric: str) -> str:
    towards = " (towards the clean run's value)" if METRICS[metric].better > 0 else " (away from the clean run's value)"
    return _ATP_READING.format(metric=metric, meaning=METRICS[metric].meaning, towards=towards)


def _atp_position_figure(rows, site, metric) -> Heatmap:
    """A layer x position-role heatmap of one site kind's mean AtP estimate on `metric`."""
    layers = sorted({r["layer"] for r in rows})
    roles = _roles_present(rows)
    values, notes = _grid(rows, "layer", "position_role", layers, roles, lambda r: r["mean_estimate"], _atp_note)
    return Heatmap(f"atp-{site}-{metric}", f"AtP estimates: {site} patched clean into corrupt, on {metric}", layers,
                   roles, values, notes, "layer", "position role", f"AtP estimate ({metric})",
                   _symmetric_limit(values), caption=_atp_reading(metric),
                   extra={"on": metric})


def _atp_heads_figure(rows, role, metric) -> Heatmap:
    """A layer x head heatmap of the heads' mean AtP estimate at one position role on `metric`."""
    layers = sorted({r["layer"] for r in rows})
    heads = sorted({r["head"] for r in rows})
    values, notes = _grid(rows, "layer", "head", layers, heads, lambda r: r["mean_estimate"], _atp_note)
    where = "every position at once" if role == "all" else f"the {role.replace('_', ' ')} position"
    return Heatmap(f"atp-heads-{role}-{metric}", f"AtP estimates: attention heads at {where}, on {metric}", layers,
                   heads, values, notes, "layer", "head", f"AtP estimate ({metric})", _symmetric_limit(values),
                   caption="Each head's output (z). " + _atp_reading(metric),
                   extra={"on": metric})


def _atp_scatter(rows, site, metric, agree) -> Scatter:
    points = [(r["estimate"], r["effect"], r["verify"]) for r in rows]
    n_rows = rows[0]["n_rows"]
    shown = "" if n_rows == len(points) else f" {len(points)} of the {n_rows} verified sites are shown (a fixed sample)."
    note = "" if agree is None or agree["correlation"] is None else \
        f"Pearson r = {agree['correlation']:.3f} over {agree['n_verified']} verified sites ({metric})"
    if agree is None or agree["correlation"] is None:
        corr = "Pearson correlation: none (fewer than two sites, or no spread)."
    else:
        corr = (f"Pearson correlation of estimate and exact effect on {metric}: r = {agree['correlation']:.3f} over "
                f"{agree['n_verified']} verified sites of {agree['n_pairs']} pairs (atp_agreement).")
    ranked = "GradDrop score" if agree is not None and agree["ranked_by"] == "graddrop" else "|estimate|"
    caption = (f"Each point is one site of one pair patched exactly: its AtP estimate against its exact effect "
               f"(patched − corrupt on {metric}). Red: among the pair's top K by {ranked}; blue: sampled at "
               f"random from the rest. On the dashed line y = x the estimate is exact. {corr}{shown}")
    return Scatter(f"atp-scatter-{site}-{metric}", f"AtP estimate against exact patching: {site}, on {metric}",
                   points, f"AtP estimate ({metric})", f"exact effect ({metric})", caption=caption, on=metric,
                   note=note)


def _direction_words(metric: str) -> str:
    """How to read a metric whose clean value is the smaller (kl, logp_corrupt, rank)."""
    if metric == "kl":
        return (" KL is 0 for the clean run and lower is closer to clean, so recovery = 1 − KL(patched) / "
                "KL(corrupt).")
    if METRICS[metric].better < 0:
        return f" On {metric} lower is closer to clean; recovery is 1 at the clean run's value all the same."
    return ""


def _patching_figure(rows, sweep, site, direction, metric) -> Heatmap:
    """A layer x position-role heatmap of one sweep, site and direction on one metric."""
    layers = sorted({r["layer"] for r in rows}, key=lambda layer: -1 if layer is None else layer)
    roles = _roles_present(rows)
    what = "clean into corrupt" if direction == "denoise" else "corrupt into clean"
    meaning = METRICS[metric].meaning
    if METRICS[metric].min_span is None:
        # no recovery (a ratio of ranks means nothing): the mean effect itself, on its own scale
        values, notes = _grid(rows, "layer", "position_role", layers, roles, lambda r: r["mean_effect"],
                              lambda r: _note(r, "effect"))
        units = f"mean effect ({metric})"
        reference = "corrupt" if direction == "denoise" else "clean"
        reading = (f"Mean effect on {metric} ({meaning}): patched − {reference}, averaged over pairs; it has no "
                   f"recovery. Rank 0 is the top token, so in denoising blue (below 0) means the patch brings "
                   f"the clean answer up, in noising red (above 0) means it pushes the clean answer down. The "
                   f"colour scale reaches this panel's largest magnitude (legend).")
        limit = _symmetric_limit(values)
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
        values, notes = _grid(rows, "layer", "position_role", layers, roles, value, _note)
        reading += _direction_words(metric) + (" Pairs whose clean − corrupt span is below the threshold are left "
                                               "out (see n_small_span).")
        limit = 1.0
    layers = ["embedding" if layer is None else layer for layer in layers]  # the embed sweep has no layer
    return Heatmap(f"{sweep}-{direction}-{metric}", f"{site} patching, {direction} ({what}), on {metric}", layers,
                   roles, values, notes, "layer", "position role", units, limit, caption=reading, metric=metric)


def _heads_figure(rows, role, metric, site="head") -> Heatmap:
    """A layer x head heatmap at one position role on one metric, scaled to its largest magnitude:
    the heads' outputs (z), or with `site` q, k or v their query, key or value (the qkv sweep)."""
    layers = sorted({r["layer"] for r in rows})
    n_heads = sorted({r["head"] for r in rows})
    if METRICS[metric].min_span is None:
        values, notes = _grid(rows, "layer", "head", layers, n_heads, lambda r: r["mean_effect"],
                              lambda r: _note(r, "effect"))
        units, shown = f"mean effect ({metric})", f"the mean effect on {metric} (patched − corrupt; no recovery)"
    else:
        values, notes = _grid(rows, "layer", "head", layers, n_heads, lambda r: r["mean_recovery"], _note)
        units, shown = f"mean recovery ({metric})", f"recovery on {metric}"
    where = "every position at once" if role == "all" else f"the {role.replace('_', ' ')} position"
    if site == "head":
        key, title, what, axis = (f"heads-{role}-{metric}", f"attention heads patched at {where}, on {metric}",
                                  "Each head's output (z)", "head")
    else:
        label = QKV_SITES[site]
        key, title = f"qkv-{site}-{role}-{metric}", f"attention heads' {label} patched at {where}, on {metric}"
        what = f"Each head's {label}" + (" (k and v: per key/value head)" if site != "q" else "")
        axis = "head" if site == "q" else "key/value head"
    return Heatmap(key, title, layers, n_heads,
                   values, notes, "layer", axis, units, _symmetric_limit(values),
                   caption=f"{what} patched clean into corrupt; {shown} ({METRICS[metric].meaning})."
                           + _direction_words(metric) + " The colour scale reaches this panel's largest magnitude "
                           "(legend), so small head effects show.", metric=metric)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-") or "none"


# ---- colours: a diverging scale centred at zero ----

_NEG, _MID, _POS = (33, 102, 172), (247, 247, 247), (178, 24, 43)


def colour(value, limit) -> str:
    if value is None:
        return "#d9d9d9"
    t = max(-1.0, min(1.0, value / limit)) if limit else 0.0
    end = _POS if t > 0 else _NEG
    a = abs(t)
    rgb = tuple(round(m + (e - m) * a) for m, e in zip(_MID, end))
    return "#{:02x}{:02x}{:02x}".format(*rgb)


# ---- SVG ----

def svg_heatmap(h: Heatmap) -> str:
    cell_w = 14 if len(h.cols) > 16 else (26 if h.small else 44)
    cell_h = 9 if h.small else (12 if len(h.rows) > 20 else 20)
    left = 112 if any(isinstance(r, str) for r in h.rows) else 46
    top, bottom = 8, 78 if any(isinstance(c, str) for c in h.cols) else 40
    legend_w = 0 if h.small else 90
    width = left + cell_w * len(h.cols) + legend_w + 10
    height = top + cell_h * len(h.rows) + bottom
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(h.title)}">']
    out.append('<g font-family="system-ui, sans-serif" font-size="11" fill="#222">')
    for i, row in enumerate(h.rows):
        y = top + i * cell_h
        show = not h.small or i % 4 == 0 or i == len(h.rows) - 1
        if show and (cell_h >= 12 or i % 2 == 0 or isinstance(row, str)):
            out.append(f'<text x="{left - 4}" y="{y + cell_h - 2}" text-anchor="end">{html.escape(str(row))}</text>')
        for j, _ in enumerate(h.cols):
            v, note = h.values[i][j], h.notes[i][j]
            tip = html.escape(f"{h.row_axis} {row}, {h.col_axis} {h.cols[j]}: {note}" if note else "no data")
            out.append(f'<rect x="{left + j * cell_w}" y="{y}" width="{cell_w}" height="{cell_h}" '
                       f'fill="{colour(v, h.limit)}" stroke="#fff" stroke-width="0.5"><title>{tip}</title></rect>')
    base = top + cell_h * len(h.rows)
    for j, col in enumerate(h.cols):
        x = left + j * cell_w + cell_w / 2
        if isinstance(col, str):
            out.append(f'<text x="{x}" y="{base + 8}" transform="rotate(40 {x} {base + 8})">'
                       f'{html.escape(col.replace("_", " "))}</text>')
        elif len(h.cols) <= 16 or j % 2 == 0:
            out.append(f'<text x="{x}" y="{base + 13}" text-anchor="middle">{col}</text>')
    axis_y = height - 6
    out.append(f'<text x="{left + cell_w * len(h.cols) / 2}" y="{axis_y}" text-anchor="middle" font-weight="600">'
               f'{html.escape(h.col_axis)}</text>')
    out.append(f'<text x="12" y="{top + cell_h * len(h.rows) / 2}" text-anchor="middle" font-weight="600" '
               f'transform="rotate(-90 12 {top + cell_h * len(h.rows) / 2})">{html.escape(h.row_axis)}</text>')
    if not h.small:
        lx = left + cell_w * len(h.cols) + 24
        lh = max(80, cell_h * len(h.rows))
        steps = 24
        for k in range(steps):
            v = h.limit * (1 - 2 * k / (steps - 1))
            out.append(f'<rect x="{lx}" y="{top + k * lh / steps}" width="14" height="{lh / steps + 0.5}" '
                       f'fill="{colour(v, h.limit)}"/>')
        for v, y in ((h.limit, top + 8), (0.0, top + lh / 2 + 4), (-h.limit, top + lh)):
            out.append(f'<text x="{lx + 18}" y="{y}">{v:+.2g}</text>')
        out.append(f'<text x="{lx + 7}" y="{top + lh + 16}" text-anchor="middle" font-size="10">'
                   f'{html.escape(h.units)}</text>')
    out.append("</g></svg>")
    return "".join(out)


_GROUP_COLOURS = {"top": colour(1.0, 1.0), "random": colour(-1.0, 1.0)}  # red, blue: the scale's ends


def _scatter_range(points) -> tuple[float, float]:
    """One range for both axes (so that y = x is the diagonal), padded by 5%."""
    values = [v for x, y, _ in points for v in (x, y)]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-9:
        lo, hi = lo - 1.0, hi + 1.0
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def svg_scatter(s: Scatter) -> str:
    size, left, top, bottom, legend_w = 300, 62, 10, 46, 110
    width, height = left + size + legend_w, top + size + bottom
    lo, hi = _scatter_range(s.points)

    def px(v):
        return left + (v - lo) / (hi - lo) * size

    def py(v):
        return top + size - (v - lo) / (hi - lo) * size

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(s.title)}">',
           '<g font-family="system-ui, sans-serif" font-size="11" fill="#222">',
           f'<rect x="{left}" y="{top}" width="{size}" height="{size}" fill="#fff" stroke="#999"/>']
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append(f'<line x1="{px(v):.1f}" y1="{top + size}" x2="{px(v):.1f}" y2="{top + size + 4}" stroke="#999"/>'
                   f'<text x="{px(v):.1f}" y="{top + size + 15}" text-anchor="middle">{v:+.2g}</text>'
                   f'<line x1="{left - 4}" y1="{py(v):.1f}" x2="{left}" y2="{py(v):.1f}" stroke="#999"/>'
                   f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:+.2g}</text>')
    if lo < 0 < hi:
        out.append(f'<line x1="{left}" y1="{py(0):.1f}" x2="{left + size}" y2="{py(0):.1f}" stroke="#e3e3e3"/>'
                   f'<line x1="{px(0):.1f}" y1="{top}" x2="{px(0):.1f}" y2="{top + size}" stroke="#e3e3e3"/>')
    out.append(f'<line x1="{px(lo):.1f}" y1="{py(lo):.1f}" x2="{px(hi):.1f}" y2="{py(hi):.1f}" stroke="#555" '
               f'stroke-dasharray="4 3"><title>y = x: the estimate equals the exact effect</title></line>')
    for group in reversed(s.groups):  # the top sites drawn last, over the sample
        for x, y, g in s.points:
            if g == group:
                tip = html.escape(f"{g}: AtP estimate {x:+.3f}, exact effect {y:+.3f} ({s.on})")
                out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{_GROUP_COLOURS.get(g, "#444")}" '
                           f'fill-opacity="0.75"><title>{tip}</title></circle>')
    out.append(f'<text x="{left + size / 2}" y="{height - 6}" text-anchor="middle" font-weight="600">'
               f'{html.escape(s.x_label)}</text>')
    out.append(f'<text x="12" y="{top + size / 2}" text-anchor="middle" font-weight="600" '
               f'transform="rotate(-90 12 {top + size / 2})">{html.escape(s.y_label)}</text>')
    lx = left + size + 14
    for k, group in enumerate(s.groups):
        n = sum(1 for *_, g in s.points if g == group)
        out.append(f'<circle cx="{lx + 5}" cy="{top + 12 + 18 * k}" r="4" fill="{_GROUP_COLOURS.get(group, "#444")}"/>'
                   f'<text x="{lx + 14}" y="{top + 16 + 18 * k}">{group} ({n})</text>')
    out.append("</g></svg>")
    return "".join(out)


# ---- PNG ----

def png_heatmap(h: Heatmap, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap, TwoSlopeNorm

    cmap = LinearSegmentedColormap.from_list("pg", [tuple(c / 255 for c in _NEG), tuple(c / 255 for c in _MID),
                                                    tuple(c / 255 for c in _POS)])
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

    lo, hi = _scatter_range(s.points)
    fig, ax = plt.subplots(figsize=(5.2, 4.6), dpi=110)
    ax.plot([lo, hi], [lo, hi], ls="--", color="#555", lw=1, label="y = x")
    for group in reversed(s.groups):
        xs = [x for x, _, g in s.points if g == group]
        ys = [y for _, y, g in s.points if g == group]
        if xs:
            ax.scatter(xs, ys, s=12, alpha=0.75, color=_GROUP_COLOURS.get(group, "#444"), label=f"{group} ({len(xs)})")
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


# ---- the page ----

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
figure { display: inline-block; margin: 10px 18px 18px 0; vertical-align: top; }
figcaption { font-size: 13px; max-width: 560px; } figcaption b { display: block; font-size: 14px; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
.multiples figure { margin-right: 8px; } .note { color: #555; font-size: 13px; }
figure.by-metric { display: none; } .metric-choice { margin: 0 2px 0 12px; }
label.metric-label { font-size: 14px; font-family: ui-monospace, monospace; cursor: pointer; }
"""


def _metric_css(metrics) -> str:
    """Rules showing the selected metric's figures: a checked radio button shows the figures of
    its class that follow it (as siblings or inside a sibling), so the page needs no script."""
    rules = []
    for k, _ in enumerate(metrics):
        rules.append(f"#metric-{k}:checked ~ figure.m-{k}, #metric-{k}:checked ~ * figure.m-{k} "
                     f"{{ display: inline-block; }} #metric-{k}:checked + label {{ font-weight: 700; }}")
    return "\n".join(rules)


def _number(v, fmt=".3f") -> str:
    return "—" if v is None else format(v, fmt)


def _atp_section(atp: dict, figure) -> list[str]:
    """The attribution-patching section: heatmaps of the estimates, estimate against exact effect,
    the top neurons per layer, and the agreement table."""
    on = ", ".join(atp["metrics"])
    parts = ["<h2>Attribution patching (AtP estimates)</h2>",
             f"<p class='note'>Every site's effect estimated from one forward and backward pass per pair "
             f"(sweep atp, on {html.escape(on)}: each pair's headline metric; these figures are shown whichever "
             f"metric is selected above). Per pair and site kind, the top K sites by the ranking score and a random "
             f"sample of the others were also patched exactly.</p>"]
    parts += [figure(h) for h in atp["figures"]]
    if atp["scatters"]:
        parts.append("<h3>Estimate against exact patching</h3>")
        parts += [figure(s) for s in atp["scatters"]]
    if atp["neurons"]:
        parts.append(f"<h3>Top neurons per layer by |mean AtP estimate|</h3><p class='note'>The "
                     f"{ATP_TOP_NEURONS} neurons of each layer with the largest mean AtP estimate in magnitude, "
                     f"each as neuron: mean estimate of its effect (patched − corrupt) on the metric named, "
                     f"over its pairs (atp_summary).</p>")
        parts.append("<table class='atp-neurons'><tr><th>metric</th><th>layer</th><th>position role</th>"
                     + "".join(f"<th>#{k + 1}</th>" for k in range(ATP_TOP_NEURONS)) + "</tr>")
        for row in atp["neurons"]:
            cells = "".join(f"<td title='{html.escape(_atp_note(r), quote=True)}'>n{r['neuron']}: "
                            f"{r['mean_estimate']:+.3f}</td>" for r in row["top"])
            cells += "<td></td>" * (ATP_TOP_NEURONS - len(row["top"]))
            parts.append(f"<tr><td>{row['metric']}</td><td>{row['layer']}</td>"
                         f"<td>{html.escape(row['position_role'].replace('_', ' '))}</td>{cells}</tr>")
        parts.append("</table>")
    parts.append("<h3>Agreement with exact patching</h3><p class='note'>Per site kind and metric (atp_agreement): "
                 "the sites screened and patched exactly; the Pearson correlation of estimate and exact effect over "
                 "the verified sites (top and random pooled; the top sites have the largest estimates, so it is "
                 "not the correlation over every site); the missed share, the estimated share of the sites with "
                 "|recovery| ≥ the threshold on that metric that the estimates ranked outside the top K (from the "
                 "random sample); and where the run also holds the exhaustive exact sweep, the recall of the exact "
                 "top K and top 10 sites by |effect| among the estimates' top K, averaged over pairs (the top-10 "
                 "recall is at most K / 10). —: not available.</p>")
    parts.append("<table class='atp-agreement'><tr><th>site</th><th>metric</th><th>pairs</th><th>sites screened</th>"
                 "<th>top</th><th>random</th><th>ranked by</th><th>correlation</th><th>threshold (|recovery|)</th>"
                 "<th>missed share</th><th>pairs with the exact sweep</th><th>recall of the exact top K</th>"
                 "<th>recall of the exact top 10</th></tr>")
    for a in atp["agreement"]:
        ranked = "GradDrop score" if a["ranked_by"] == "graddrop" else "|estimate|"
        parts.append(f"<tr><td>{a['site']}</td><td>{a['metric']}</td><td>{a['n_pairs']}</td><td>{a['n_sites']}</td>"
                     f"<td>{a['n_top']}</td><td>{a['n_random']}</td><td>{ranked}</td>"
                     f"<td>{_number(a['correlation'])}</td><td>{a['threshold']:g} ({a['metric']})</td>"
                     f"<td>{_number(a['missed_share'])}</td><td>{a['n_pairs_exact']}</td>"
                     f"<td>{_number(a['recall_top_k'])}</td><td>{_number(a['recall_top_10'])}</td></tr>")
    parts.append("</table>")
    return parts


def _paths_section(paths: dict, figure) -> list[str]:
    """The path-patching section: one sender x receiver matrix per metric and position role."""
    params = paths["params"]
    ends = "; ".join(f"{k.removeprefix('path_')}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
                     for k in ("path_senders", "path_receivers", "path_inputs") if (v := params.get(k)) is not None)
    parts = ["<h2>Path patching</h2>",
             f"<p class='note'>Sweep paths (path_summary): each sender's clean output patched into the corrupt run "
             f"along one path only, to the logits or to a later head's query, key or value input; every other "
             f"reader of the stream sees the corrupt run. {html.escape(paths['mlps'])}"
             + (f" Run settings: {html.escape(ends)}." if ends else "")
             + " Rows: senders by layer (heads, then attn_out, then mlp_out); columns: logits first, then "
             "receivers by layer, head and input. The matrices follow the metric chosen above.</p>"]
    parts += [figure(h) for h in paths["figures"]]
    return parts


def write_report(warehouse: str | Path, out: str | Path, run_id: str | None = None) -> Path:
    from .warehouse.loader import connect

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    con = connect(warehouse)
    try:
        if run_id is None:
            latest = con.execute("SELECT run_id FROM run_overview ORDER BY started DESC NULLS LAST LIMIT 1").fetchone()
            if latest is None:
                raise ValueError(f"warehouse {warehouse} holds no runs")
            run_id = latest[0]
        data = collect(con, run_id)
    finally:
        con.close()
    info = data["info"]
    metrics = data["metrics"]
    index = {m: k for k, m in enumerate(metrics)}
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>patchgrid report {html.escape(run_id)}"
             f"</title><style>{_CSS}{_metric_css(metrics)}</style></head><body>",
             f"<h1>patchgrid study {html.escape(run_id)}</h1>",
             f"<p class='note'>Model <b>{html.escape(str(info['model']))}</b>; "
             f"{info['n_accepted']} pairs accepted of {info['n_records']} records; "
             f"{info['n_swept']} pairs swept; status {html.escape(str(info['status']))}; "
             f"started {info['started']}, finished {info['finished']}; code {html.escape(str(info['code_version']))}."
             f" Hover a cell for its mean and metric, 95% t interval and pair count. Red marks what matters: "
             f"denoising, the patch restores the clean answer; noising, the site carries it; tracing, restoring "
             f"the state raises p(answer); rank, which has no recovery, is drawn as its mean effect. Each "
             f"figure's caption says what it plots.</p>"]
    if metrics:
        # the radio buttons come before every figure they switch: CSS selects only later siblings
        parts.append("<p class='note'>The patching and head figures are drawn on every metric the run has; choose "
                     "one (hover its name for what it is; the Metrics table below lists them):</p>")
        for k, m in enumerate(metrics):
            parts.append(f"<input type='radio' name='metric' class='metric-choice' id='metric-{k}' value='{m}'"
                         f"{' checked' if k == 0 else ''}><label class='metric-label' for='metric-{k}' "
                         f"title='{html.escape(METRICS[m].meaning, quote=True)}'>{m}</label>")
    n = 0

    def figure(h: Heatmap | Scatter):
        nonlocal n
        n += 1
        scatter = isinstance(h, Scatter)
        (png_scatter if scatter else png_heatmap)(h, out / f"{h.key}.png")
        switched = f" class='by-metric m-{index[h.metric]}' data-metric='{h.metric}'" if h.metric in index else ""
        return (f"<figure id='fig-{n}'{switched} data-png='{h.key}.png'>{svg_scatter(h) if scatter else svg_heatmap(h)}"
                f"<figcaption><b>{html.escape(h.title)}</b>{html.escape(h.caption)}</figcaption></figure>")

    sections = [("Layer × position patching", [h for h in data["figures"] if not h.key.startswith(("heads", "qkv",
                                                                                                   "trace"))]),
                ("Attention heads", [h for h in data["figures"] if h.key.startswith(("heads", "qkv"))]),
                ("Causal tracing", [h for h in data["figures"] if h.key.startswith("trace")])]
    for name, figs in sections:
        if figs:
            parts.append(f"<h2>{name}</h2>")
            parts += [figure(h) for h in figs]
    if data["paths"]:
        parts += _paths_section(data["paths"], figure)
    if data["atp"]:
        parts += _atp_section(data["atp"], figure)
    if data["multiples"]:
        parts.append("<h2>By relation: resid patching, clean into corrupt</h2><div class='multiples'>")
        parts += [figure(h) for h in data["multiples"]]
        parts.append("</div>")
    parts.append("<h2>Run</h2><table>")
    for k, v in _params(info["params"]).items():
        parts.append(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v))}</td></tr>")
    parts.append("</table><h2>Metrics</h2><table><tr><th>metric</th><th>what it is</th><th>the clean run's value is"
                 "</th><th>recovery</th></tr>")
    for m in metrics:
        spec = METRICS[m]
        parts.append(f"<tr><td>{m}</td><td>{html.escape(spec.meaning)}</td><td>{'larger' if spec.better > 0 else 'smaller'}"
                     f"</td><td>{'none' if spec.min_span is None else f'pairs with span ≥ {spec.min_span:g}'}</td></tr>")
    parts.append("</table><h2>Rejected records by reason</h2><table><tr><th>reason</th><th>records</th></tr>")
    for r in data["rejections"]:
        parts.append(f"<tr><td>{html.escape(str(r['reason']))}</td><td>{r['n']}</td></tr>")
    parts.append("</table></body></html>")
    page = out / "report.html"
    page.write_text("".join(parts), encoding="utf-8")
    return page
