"""A study's pictures: one self-contained HTML page and each figure as PNG, SVG and PDF files, from
the warehouse's views; by default of the latest completed run. A run that did not complete (failed,
cancelled, still running) is reported with its status, the reason it ended and what it loaded.

The page has its styles, data and figures (inline SVG) inside it and makes no network request.
Every heatmap's colour scale is centred at zero and has its colour bar with its units, its axes are
labelled with layer numbers and role names, no label is clipped or drawn over another, and each
cell's hover text gives the mean, its metric, its 95% interval and the pair count; a cell averaged
over fewer than FEW_PAIRS (5) pairs is faded and dotted, and the caption says so.

Each sweep kind declares how the report draws it (`patchgrid.sweeps.SWEEP_KINDS[name].drawing`),
and the page has one section per drawing (sections.py), a drawing's kinds in registry order:

    layer_by_role  layer x position role per (sweep, site, direction): the position sweeps
    layer_by_head  layer x head per position role and site: heads, and q, k and v one panel each
    trace_buckets  causal tracing as Meng et al. draw it: token bucket x layer on p(answer)
    paths          per metric and position role, a sender x receiver matrix of each path's mean
                   effect (path_summary), its caption saying whether the MLPs were frozen (direct
                   paths) or recomputed (the run's path_mlps)
    atp            on the metric the estimates are on (each pair's headline metric), whichever
                   metric is selected: the estimates' layer x role and layer x head heatmaps
                   (atp_summary), estimate-against-exact scatter plots of the sites also patched
                   exactly, the top neurons per layer, and the agreement numbers (atp_agreement)
    edges          per position role, a sender x receiver matrix of the strongest edges' mean
                   EAP or EAP-IG score (edge_summary), on the score's own metric
    knockout       attention knockout as Geva et al. draw it: per group the last position was blocked
                   from, the relative change in p(answer) by layer with its t interval (knockout_curve)
    none           not drawn (a cell per neuron)

A run without a drawing's rows has no such section. The patching and head heatmaps and the path
matrices are drawn once per metric the run has (`patchgrid.metrics`), and the page shows one metric
at a time: a row of radio buttons selects it with CSS alone (no script), the headline metric
(logprob_diff, else logit_diff for older loads) first. The small multiples by relation are of the
first kind drawn layer_by_role, on the headline metric.

    queries.py        what the report reads from the warehouse's views
    sections.py       one section per drawing: which kinds it draws, its figures; collect()
    patching.py       exact patching's layer x role and layer x head heatmaps, the small multiples
    buckets.py        causal tracing by token bucket
    path_matrices.py  path patching's sender x receiver matrices
    edge_matrices.py  edge attribution's sender x receiver matrices
    estimates.py      attribution patching's heatmaps, scatter plots and neuron table
    knockout_figures.py  attention knockout's curve by layer and its table
    figures.py        the figures as data (Heatmap, Scatter) and the grid helpers
    colours.py        the diverging colour scale
    svg.py            drawing a figure inline (its labels placed from their measured extents)
    files.py          drawing a figure as PNG, SVG and PDF files (matplotlib)
    page.py           the HTML page: write_report
"""
from .colours import colour
from .figures import Heatmap, Scatter
from .files import FORMATS, heatmap_figure, scatter_figure, write_figure
from .page import write_report
from .sections import collect
from .svg import svg_heatmap, svg_scatter

__all__ = ["FORMATS", "Heatmap", "Scatter", "collect", "colour", "heatmap_figure", "scatter_figure", "svg_heatmap",
           "svg_scatter", "write_figure", "write_report"]
