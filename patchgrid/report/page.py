"""The report's page: one self-contained HTML file (styles, data and inline SVG figures inside it,
no network request, no script) and each figure as PNG, SVG and PDF files beside it (linked from its
caption), from `sections.collect`. A run that did not complete says so first: its status, the
reason it ended, and what it loaded."""
from __future__ import annotations

import html
import json
from pathlib import Path

from ..metrics import METRICS
from .circuit_svg import svg_circuit, svg_curve, svg_layer_curve
from .estimates import TOP_NEURONS, estimate_note
from .figures import CircuitDiagram, Curve, Heatmap, LayerCurve, Scatter
from .files import FORMATS, write_figure
from .reads import latest_completed_run, run_params, runs_by_status
from .sections import DRAWINGS, collect
from .svg import svg_heatmap, svg_scatter

CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
figure { display: inline-block; margin: 10px 18px 18px 0; vertical-align: top; }
figcaption { font-size: 13px; max-width: 560px; } figcaption b { display: block; font-size: 14px; }
table { border-collapse: collapse; font-size: 13px; } \
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
.multiples figure { margin-right: 8px; } .note { color: #555; font-size: 13px; }
figure.by-metric { display: none; } .metric-choice { margin: 0 2px 0 12px; }
label.metric-label { font-size: 14px; font-family: ui-monospace, monospace; cursor: pointer; }
figcaption .files { display: block; margin-top: 2px; } figcaption .files a { margin-right: 6px; }
.run-ended { border: 2px solid #b2182b; background: #fdf1f1; padding: 8px 12px; font-size: 14px; max-width: 900px; }
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


class FigureWriter:
    """Each figure as a <figure> of the page, its files (`formats`) written beside it and linked
    from its caption; figures with a metric are switched by the metric buttons."""

    def __init__(self, out: Path, metrics, formats=FORMATS):
        self.out, self.index, self.n, self.formats = out, {m: k for k, m in enumerate(metrics)}, 0, formats
        self.files: list[Path] = []  # every file written, in order

    def __call__(self, h: Heatmap | Scatter | Curve | CircuitDiagram | LayerCurve) -> str:
        self.n += 1
        plain = not isinstance(h, Heatmap)  # no cell counts in its caption
        files = write_figure(h, self.out, self.formats)
        self.files += files
        links = " ".join(f"<a href='{html.escape(p.name, quote=True)}'>{p.suffix[1:].upper()}</a>" for p in files)
        switched = (f" class='by-metric m-{self.index[h.metric]}' data-metric='{h.metric}'"
                    if h.metric in self.index else "")
        caption = h.caption + ("" if plain else h.counts_caption())
        return (f"<figure id='fig-{self.n}'{switched} data-png='{h.key}.png'>"
                f"{SVG[type(h)](h)}"
                f"<figcaption><b>{html.escape(h.title)}</b>{html.escape(caption)}"
                f"<span class='files'>{links}</span></figcaption></figure>")


SVG = {Heatmap: svg_heatmap, Scatter: svg_scatter, Curve: svg_curve, CircuitDiagram: svg_circuit,
       LayerCurve: svg_layer_curve}


def _neuron_table(neurons) -> list[str]:
    parts = [f"<h3>Top neurons per layer by |mean AtP estimate|</h3><p class='note'>The "
             f"{TOP_NEURONS} neurons of each layer with the largest mean AtP estimate in magnitude, "
             f"each as neuron: mean estimate of its effect (patched − corrupt) on the metric named, "
             f"over its pairs (atp_summary).</p>",
             "<table class='atp-neurons'><tr><th>metric</th><th>layer</th><th>position role</th>"
             + "".join(f"<th>#{k + 1}</th>" for k in range(TOP_NEURONS)) + "</tr>"]
    for row in neurons:
        cells = "".join(f"<td title='{html.escape(estimate_note(r), quote=True)}'>n{r['neuron']}: "
                        f"{r['mean_estimate']:+.3f}</td>" for r in row["top"])
        cells += "<td></td>" * (TOP_NEURONS - len(row["top"]))
        parts.append(f"<tr><td>{row['metric']}</td><td>{row['layer']}</td>"
                     f"<td>{html.escape(row['position_role'].replace('_', ' '))}</td>{cells}</tr>")
    parts.append("</table>")
    return parts


def atp_html(atp: dict, figure) -> list[str]:
    """The attribution-patching section: heatmaps of the estimates, estimate against exact effect,
    the top neurons per layer, and the agreement table."""
    on = ", ".join(atp["metrics"])
    parts = [f"<h2>{DRAWINGS['atp'][0]}</h2>",
             f"<p class='note'>Every site's effect estimated from one forward and backward pass per pair "
             f"(sweep {html.escape(atp['sweep'])}, on {html.escape(on)}: each pair's headline metric; these figures "
             f"are shown whichever metric is selected above). Per pair and site kind, the top K sites by the ranking "
             f"score and a random sample of the others were also patched exactly.</p>"]
    parts += [figure(h) for h in atp["figures"]]
    if atp["scatters"]:
        parts.append("<h3>Estimate against exact patching</h3>")
        parts += [figure(s) for s in atp["scatters"]]
    if atp["neurons"]:
        parts += _neuron_table(atp["neurons"])
    return parts + _agreement_table(atp["agreement"])


AGREEMENT_NOTE = (
    "<h3>Agreement with exact patching</h3><p class='note'>Per site kind, scope and metric (atp_agreement, "
    "its intervals from warehouse/agreement.py). Scope: every_position, the sites patched at every position at "
    "once; per_position, those at one position; each has its own top K and random sample. The Pearson and "
    "Spearman correlations of estimate and exact effect are over the random sample alone (each pair's seeded "
    "sample of R of the sites outside its top K, pooled over pairs: they estimate the correlation over the sites "
    "outside the top K, each pair weighing the same); the pooled Pearson, over the top and random sites, is "
    "biased upwards by the top K's choice. The missed share is the estimated share of the important sites "
    "(|recovery| ≥ the threshold on that metric, in pairs whose clean − corrupt span passes the metric's "
    "guard; the pairs that fail it are counted and left out) that the estimates ranked outside the top K (from "
    "the random sample). Where the run also holds the exhaustive exact sweep: the recall of the exact top K and "
    "top 10 sites by |effect| among the estimates' top K, averaged over pairs (the top-10 recall is at most "
    "K / 10). In brackets, 95% percentile bootstrap intervals resampling pairs. —: not available.</p>")
AGREEMENT_HEAD = (
    "<table class='atp-agreement'><tr><th>site</th><th>scope</th><th>metric</th><th>pairs</th>"
    "<th>sites screened</th><th>top</th><th>random</th><th>ranked by</th><th>Pearson (random)</th>"
    "<th>Spearman (random)</th><th>Pearson (pooled)</th><th>threshold (|recovery|)</th><th>pairs unguarded</th>"
    "<th>missed share</th><th>pairs with the exact sweep</th><th>recall of the exact top K</th>"
    "<th>recall of the exact top 10</th></tr>")


def with_interval(row, name: str) -> str:
    """A figure of an agreement row with its bootstrap interval: `0.812 [0.701, 0.893]`, `—` without it."""
    low, high = row.get(f"{name}_ci95_low"), row.get(f"{name}_ci95_high")
    return _number(row[name]) + ("" if low is None or row[name] is None else f" [{low:.3f}, {high:.3f}]")


def _agreement_table(agreement) -> list[str]:
    parts = [AGREEMENT_NOTE, AGREEMENT_HEAD]
    for a in agreement:
        ranked = "GradDrop score" if a["ranked_by"] == "graddrop" else "|estimate|"
        figures = "".join(f"<td>{with_interval(a, name)}</td>" for name in ("pearson_random", "spearman_random"))
        parts.append(f"<tr><td>{a['site']}</td><td>{a['scope']}</td><td>{a['metric']}</td><td>{a['n_pairs']}</td>"
                     f"<td>{a['n_sites']}</td><td>{a['n_top']}</td><td>{a['n_random']}</td><td>{ranked}</td>"
                     f"{figures}<td>{_number(a['pearson_pooled'])}</td><td>{a['threshold']:g} ({a['metric']})</td>"
                     f"<td>{a['n_pairs_unguarded']}</td><td>{with_interval(a, 'missed_share')}</td>"
                     f"<td>{a['n_pairs_exact']}</td><td>{with_interval(a, 'recall_top_k')}</td>"
                     f"<td>{with_interval(a, 'recall_top_10')}</td></tr>")
    parts.append("</table>")
    return parts


def paths_html(paths: dict, figure) -> list[str]:
    """The path-patching section: one sender x receiver matrix per metric and position role."""
    params = paths["params"]
    ends = "; ".join(f"{k.removeprefix('path_')}: {', '.join(map(str, v)) if isinstance(v, list) else v}"
                     for k in ("path_senders", "path_receivers", "path_inputs") if (v := params.get(k)) is not None)
    parts = [f"<h2>{DRAWINGS['paths'][0]}</h2>",
             f"<p class='note'>Sweep {html.escape(paths['sweep'])} (path_summary): each sender's clean output "
             f"patched into the corrupt run along one path only, to the logits or to a later head's query, key or "
             f"value input; every other reader of the stream sees the corrupt run. {html.escape(paths['mlps'])}"
             + (f" Run settings: {html.escape(ends)}." if ends else "")
             + " Rows: senders by layer (heads, then attn_out, then mlp_out); columns: logits first, then "
             "receivers by layer, head and input. The matrices follow the metric chosen above.</p>"]
    parts += [figure(h) for h in paths["figures"]]
    return parts


def grid_html(drawing: str, figures, figure) -> list[str]:
    """A section of heatmaps under the drawing's heading; nothing when it has none."""
    if not figures:
        return []
    return [f"<h2>{DRAWINGS[drawing][0]}</h2>", *(figure(h) for h in figures)]


def edges_html(edges: dict, figure) -> list[str]:
    """The edge attribution section: the strongest edges' mean scores, one matrix per position role."""
    return [f"<h2>{DRAWINGS['edges'][0]}</h2>",
            f"<p class='note'>Sweep {html.escape(edges['sweep'])} (edge_summary): every one of the model's "
            f"{edges['n_edges']} edges scored for every pair by {html.escape(edges['method'])}, from gradients on "
            "transformers; edges from the input, each head and each MLP into each later head's query, key and value, "
            "each later MLP and the logits. Scores are estimates, not patched runs; the matrices are on their own "
            "metric, whatever is chosen above.</p>",
            *(figure(h) for h in edges["figures"]), *_edge_agreement_table(edges.get("agreement") or [])]


def _edge_agreement_table(agreement) -> list[str]:
    """How the scores compare with the edges patched exactly (edge_agreement, bootstrap intervals over pairs)."""
    if not agreement:
        return []
    parts = ["<p class='note'>Agreement with exact patching (edge_agreement): per pair the K edges of largest "
             "|score| and R sampled from the rest were patched exactly (path patching, MLPs frozen). Correlations "
             "of score and exact effect over the random sample (the edges outside the top K); recall: the "
             "estimated share of the important edges (|recovery| ≥ 0.1) that the top K holds. In brackets: "
             "95% bootstrap intervals over pairs.</p>",
             "<table><tr><th>metric</th><th>pairs</th><th>top K rows</th><th>random rows</th>"
             "<th>Pearson (random)</th><th>Spearman (random)</th><th>recall of important edges</th></tr>"]
    for a in agreement:
        parts.append(f"<tr><td>{a['metric']}</td><td>{a['n_pairs']}</td><td>{a['n_top']}</td><td>{a['n_random']}</td>"
                     f"<td>{with_interval(a, 'pearson_random')}</td><td>{with_interval(a, 'spearman_random')}</td>"
                     f"<td>{with_interval(a, 'recall_important')}</td></tr>")
    parts.append("</table>")
    return parts


# drawing -> how its section is written (every other drawing: grid_html)
def circuit_html(circuit: dict, figure) -> list[str]:
    """The circuits section: MIB's faithfulness curves, the CPR and CMD table, and one circuit drawn."""
    parts = [f"<h2>{DRAWINGS['circuit'][0]}</h2>",
             "<p class='note'>Sweep circuit (circuit_curve, circuit_score): circuits of the graph's edges at each "
             "size, ranked by the edges' mean score over the pairs, each run on the engine for every pair with the "
             "edges outside it given the ablation's value; faithfulness (m(C) − m(empty)) / (m(full) − m(empty)) on "
             f"{html.escape(circuit['metric'])}, MIB's ratio of means (bars: the mean of the pairs' faithfulness "
             "with its 95% t interval). CPR: the area under the curve over the share of edges; CMD: the area "
             "between it and 1.</p>",
             figure(circuit["curve"]),
             "<table><tr><th>method</th><th>build</th><th>ablation</th><th>sizes</th><th>CPR (higher is better)</th>"
             "<th>CMD (lower is better)</th></tr>"]
    for r in circuit["scores"]:
        parts.append(f"<tr><td>{html.escape(str(r['method']))}</td><td>{html.escape(str(r['build']))}</td>"
                     f"<td>{html.escape(str(r['ablation']))}</td><td>{r['n_sizes']}</td><td>{_number(r['cpr'])}</td>"
                     f"<td>{_number(r['cmd'])}</td></tr>")
    parts.append("</table>")
    if circuit.get("diagram") is not None:
        parts.append(figure(circuit["diagram"]))
    return parts


def knockout_html(knockout: dict, figure) -> list[str]:
    """The attention knockout section: the relative change in p by layer per group blocked, and per group
    the layer where blocking it lowers p the most."""
    parts = [f"<h2>{DRAWINGS['knockout'][0]}</h2>",
             "<p class='note'>Sweep knockout (knockout_curve): on each fact's clean prompt, the last position's "
             "attention to one group of positions (the subject's tokens; every other token but the last; the last "
             "token itself) is set to minus infinity before the softmax, in every head, over a window of "
             f"{knockout['window']} layers centred on each layer. Per fact, the relative change "
             "100 (p_knocked − p_clean) / p_clean of p(answer); averaged over the facts whose clean p is above 0 "
             f"({knockout['n_facts']}) with a 95% t interval, facts taken as independent.</p>",
             figure(knockout["curve"]),
             "<p class='note'>Per group, the layer where blocking it lowers p the most:</p>"
             "<table class='knockout-deepest'><tr><th>blocked</th><th>layer of the largest drop</th>"
             "<th>mean relative change (%)</th><th>95% t interval (%)</th><th>facts</th></tr>"]
    for label, r in knockout["deepest"]:
        low, high = r["relative_change_ci95_low"], r["relative_change_ci95_high"]
        interval = "—" if low is None else f"{low:+.1f} to {high:+.1f}"
        parts.append(f"<tr><td>{html.escape(label)}</td><td>{r['layer']}</td>"
                     f"<td>{r['mean_relative_change_pct']:+.1f}</td><td>{interval}</td><td>{r['n_relative']}</td></tr>")
    parts.append("</table>")
    return parts


SECTION_HTML = {"paths": paths_html, "atp": atp_html, "edges": edges_html, "circuit": circuit_html,
                "knockout": knockout_html}

INTRO = (" Hover a cell for its mean and metric, 95% t interval and pair count. Red marks what matters: "
         "denoising, the patch restores the clean answer; noising, the site carries it; tracing, restoring "
         "the state raises p(answer); rank, which has no recovery, is drawn as its mean effect. Each "
         "figure's caption says what it plots.</p>")


ENDED = {
    "failed": "This run failed",
    "cancelled": "This run was cancelled (SIGTERM or SIGINT)",
    "running": "This run has not finished: it is still running, or its process was killed before it could say "
               "how it ended",
}


def run_ended(info: dict, n_effects: int) -> str:
    """For a run that did not complete: its status, the reason it ended (runs.reason) and what it
    loaded; for a completed run with nothing to draw, that it has none. Empty otherwise."""
    status = str(info["status"])
    loaded = (f"{info['n_records']} records ({info['n_accepted']} pairs accepted, {info['n_rejected']} records "
              f"rejected: by reason in the table below), {info['n_swept']} pairs swept, {n_effects} effect rows")
    nothing = "" if n_effects else "; so there is no figure to draw"
    if status == "completed":
        return "" if n_effects else f"<p class='run-ended'>This run completed with nothing to draw: {loaded}.</p>"
    head = ENDED.get(status, f"This run's status is {status}")
    why = info.get("reason") or "no reason was recorded"
    return (f"<p class='run-ended' id='run-ended'><b>{html.escape(head)}: {html.escape(str(why))}</b><br>"
            f"What it loaded into the warehouse: {html.escape(loaded)}{nothing}.</p>")


def _head(run_id: str, info: dict, metrics, n_effects: int) -> list[str]:
    """The page's head, title, run line, how the run ended unless it completed, and the metric buttons."""
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>patchgrid report "
             f"{html.escape(run_id)}</title><style>{CSS}{_metric_css(metrics)}</style></head><body>",
             f"<h1>patchgrid study {html.escape(run_id)}</h1>",
             f"<p class='note'>Model <b>{html.escape(str(info['model']))}</b>; "
             f"{info['n_accepted']} pairs accepted of {info['n_records']} records; "
             f"{info['n_swept']} pairs swept; status {html.escape(str(info['status']))}; "
             f"started {info['started']}, finished {info['finished']}; code {html.escape(str(info['code_version']))}."
             + INTRO, run_ended(info, n_effects)]
    if metrics:
        # the radio buttons come before every figure they switch: CSS selects only later siblings
        parts.append("<p class='note'>The patching and head figures are drawn on every metric the run has; choose "
                     "one (hover its name for what it is; the Metrics table below lists them):</p>")
        for k, m in enumerate(metrics):
            parts.append(f"<input type='radio' name='metric' class='metric-choice' id='metric-{k}' value='{m}'"
                         f"{' checked' if k == 0 else ''}><label class='metric-label' for='metric-{k}' "
                         f"title='{html.escape(METRICS[m].meaning, quote=True)}'>{m}</label>")
    return parts


def _sections(data: dict, figure) -> list[str]:
    """Every drawing's section in DRAWINGS order, then the small multiples by relation."""
    parts = []
    for drawing, section in data["sections"].items():
        if drawing in SECTION_HTML:
            parts += SECTION_HTML[drawing](section, figure) if section else []
        else:
            parts += grid_html(drawing, section, figure)
    if data["multiples"]:
        parts.append(f"<h2>By relation: {html.escape(data['multiples_sweep'])} patching, clean into corrupt</h2>"
                     "<div class='multiples'>")
        parts += [figure(h) for h in data["multiples"]]
        parts.append("</div>")
    return parts


def _tables(info: dict, metrics, rejections) -> list[str]:
    """The run's params, the metrics and the rejected records."""
    parts = ["<h2>Run</h2><table>"]
    for k, v in run_params(info["params"]).items():
        parts.append(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(json.dumps(v))}</td></tr>")
    parts.append("</table><h2>Metrics</h2><table><tr><th>metric</th><th>what it is</th><th>the clean run's value is"
                 "</th><th>recovery</th></tr>")
    for m in metrics:
        spec = METRICS[m]
        recovery = "none" if spec.min_span is None else f"pairs with span ≥ {spec.min_span:g}"
        parts.append(f"<tr><td>{m}</td><td>{html.escape(spec.meaning)}</td>"
                     f"<td>{'larger' if spec.better > 0 else 'smaller'}</td><td>{recovery}</td></tr>")
    parts.append("</table><h2>Rejected records by reason</h2><table><tr><th>reason</th><th>records</th></tr>")
    for r in rejections:
        parts.append(f"<tr><td>{html.escape(str(r['reason']))}</td><td>{r['n']}</td></tr>")
    parts.append("</table></body></html>")
    return parts


def no_completed_run(warehouse, by_status) -> str:
    """Why there is no default run: the warehouse's runs by status, and what to do."""
    if not by_status:
        return f"warehouse {warehouse} holds no runs"
    runs = ", ".join(f"{r['n']} {r['status']} (latest {r['latest']})" for r in by_status)
    return (f"warehouse {warehouse} has no completed run (its runs: {runs}); --run RUN_ID reports any run, one that "
            f"did not complete with the reason it ended")


def read_run(warehouse: str | Path, run_id: str | None, circuit_size: float | None = None) -> tuple[str, dict]:
    """The run (default: the latest completed run) and everything its page shows (`circuit_size`: the
    circuit drawn, in percent of the edges; None: circuit_figures chooses)."""
    from ..warehouse.loader import connect

    con = connect(warehouse)
    try:
        if run_id is None:
            run_id = latest_completed_run(con)
            if run_id is None:
                raise ValueError(no_completed_run(warehouse, runs_by_status(con)))
        return run_id, collect(con, run_id, circuit_size)
    finally:
        con.close()


# In a report's folder: the run it drew and the files it wrote, so that the next report written there
# replaces them (a figure the new run has no use for does not stay beside its page).
WRITTEN = ".patchgrid-report.json"


def write_report(warehouse: str | Path, out: str | Path, run_id: str | None = None, formats=FORMATS,
                 circuit_size: float | None = None) -> Path:
    """The run's page (report.html) and its figures' files (PNG, SVG and PDF; `formats`) in `out`;
    returns the page's path. run_id None: the latest completed run; a run that did not complete is
    reported with its status, the reason it ended and what it loaded. The files an earlier report wrote
    into `out` that this one does not write again are removed (`WRITTEN` names them); nothing else there is
    touched."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run_id, data = read_run(warehouse, run_id, circuit_size)
    figure = FigureWriter(out, data["metrics"], formats)
    parts = _head(run_id, data["info"], data["metrics"], data["n_effects"]) + _sections(data, figure)
    parts += _tables(data["info"], data["metrics"], data["rejections"])
    page = out / "report.html"
    page.write_text("".join(parts), encoding="utf-8")
    written = sorted({page.name, *(f.name for f in figure.files)})
    for name in set(_written(out)["files"]) - set(written):
        (out / name).unlink(missing_ok=True)
    (out / WRITTEN).write_text(json.dumps({"run_id": run_id, "files": written}, indent=1), encoding="utf-8")
    return page


def drawn_run(out: str | Path) -> str | None:
    """The run whose report is in folder `out` (None: no report written there)."""
    return _written(Path(out))["run_id"]


def _written(out: Path) -> dict:
    try:
        found = json.loads((out / WRITTEN).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"run_id": None, "files": []}
    names = [n for n in found.get("files", []) if isinstance(n, str) and Path(n).name == n]  # only its own folder's
    return {"run_id": found.get("run_id"), "files": names}
