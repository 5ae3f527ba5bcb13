"""The report's sections, one per drawing: each sweep kind declares how the report draws it
(`patchgrid.sweeps.SWEEP_KINDS[name].drawing`), and each drawing is one function here that reads its
view and makes its figures. Sections come in DRAWINGS order, a drawing's kinds in registry order;
no sweep kind is named here. `collect` gathers everything the page shows."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..metrics import METRICS
from ..sweeps import SWEEP_KINDS
from . import estimates
from . import reads as queries
from .buckets import METRIC as BUCKET_METRIC
from .buckets import bucket_figures
from .circuit_figures import circuit_section
from .edge_matrices import edge_section
from .estimates import estimate_section
from .figures import HEADLINE
from .knockout_figures import knockout_section
from .patching import head_figures, position_figures, relation_multiples
from .path_matrices import path_section

# A sweep in the warehouse that the registry does not know (a kind since removed) is drawn as this.
UNKNOWN_DRAWING = "layer_by_role"


@dataclass
class Run:
    """What every section reads: the run's connection, its effect_summary rows, the page's metrics
    (the headline first) and its params."""

    con: object
    run_id: str
    summary: list
    metrics: list
    params: dict
    circuit_size: float | None = None  # the circuit drawn (percent of the edges); None: chosen


def layer_by_role(run: Run, kinds: list[str]):
    return position_figures(run.summary, kinds, run.metrics)


def layer_by_head(run: Run, kinds: list[str]):
    return head_figures(run.summary, kinds, run.metrics)


def trace_buckets(run: Run, kinds: list[str]):
    """The trace_buckets view (every such kind's rows averaged together), keyed by the first kind."""
    return bucket_figures(queries.trace_buckets(run.con, run.run_id, BUCKET_METRIC), kinds[0])


def paths(run: Run, kinds: list[str]):
    return path_section(queries.path_summary(run.con, run.run_id), run.metrics, run.params, kinds[0])


def edges(run: Run, kinds: list[str]):
    section = edge_section(queries.edge_summary(run.con, run.run_id), kinds[0])
    if section is not None:
        section["agreement"] = queries.edge_agreement(run.con, run.run_id)
    return section


def circuit(run: Run, kinds: list[str]):
    return circuit_section(run.con, run.run_id, kinds[0], run.circuit_size)


def knockout(run: Run, kinds: list[str]):
    return knockout_section(run.con, run.run_id, kinds[0])


def atp(run: Run, kinds: list[str]):
    summary = queries.atp_summary(run.con, run.run_id)
    if not summary:
        return None
    agreement = queries.atp_agreement(run.con, run.run_id, estimates.SITES)
    verified = queries.verified_estimates(run.con, run.run_id, estimates.SCATTER_POINTS)
    return estimate_section(summary, agreement, verified, kinds[0])


# drawing -> (its section's heading on the page, the function making its figures); `none`: not drawn
DRAWINGS = {
    "layer_by_role": ("Layer × position patching", layer_by_role),
    "layer_by_head": ("Attention heads", layer_by_head),
    "trace_buckets": ("Causal tracing", trace_buckets),
    "paths": ("Path patching", paths),
    "atp": ("Attribution patching (AtP estimates)", atp),
    "edges": ("Edge attribution (EAP and EAP-IG scores)", edges),
    "circuit": ("Circuits and their faithfulness (MIB's circuit track)", circuit),
    "knockout": ("Attention knockout (Geva et al. 2023)", knockout),
}
GRIDS = ("layer_by_role", "layer_by_head", "trace_buckets")  # drawings whose section is a list of heatmaps


def kinds_by_drawing(sweeps=()) -> dict[str, list[str]]:
    """Each drawing's kinds in registry order; `sweeps` the registry does not know are drawn as
    UNKNOWN_DRAWING, after its kinds, by name."""
    out = defaultdict(list)
    for name, kind in SWEEP_KINDS.items():
        out[kind.drawing].append(name)
    out[UNKNOWN_DRAWING] += sorted(set(sweeps) - set(SWEEP_KINDS))
    return out


def page_metrics(summary) -> tuple[list[str], str | None]:
    """The metrics the run has, the headline first (logprob_diff, else logit_diff), then in METRICS order."""
    present = {r["metric"] for r in summary}
    metrics = [m for m in METRICS if m in present]
    headline = next((m for m in HEADLINE if m in present), metrics[0] if metrics else None)
    return ([headline] + [m for m in metrics if m != headline] if headline else []), headline


def collect(con, run_id: str, circuit_size: float | None = None) -> dict:
    """Everything the page shows, read from the views only.

    sections: drawing -> its section (a list of heatmaps for GRIDS; a dict, or None without rows,
    for the others), in DRAWINGS order; figures: every grid section's heatmaps in that order;
    multiples: the by-relation panels of the first kind drawn layer_by_role (multiples_sweep)."""
    info = queries.run_overview(con, run_id)
    if info is None:
        raise ValueError(f"run {run_id!r} is not in the warehouse")
    summary = queries.effect_summary(con, run_id)
    metrics, headline = page_metrics(summary)
    run = Run(con, run_id, summary, metrics, queries.run_params(info["params"]), circuit_size)
    kinds = kinds_by_drawing({r["sweep"] for r in summary})
    sections = {drawing: make(run, kinds[drawing]) for drawing, (_, make) in DRAWINGS.items() if kinds[drawing]}
    multiples_sweep = kinds[UNKNOWN_DRAWING][0] if kinds[UNKNOWN_DRAWING] else None
    by_relation = queries.relation_summary(con, run_id, multiples_sweep) if multiples_sweep else []
    return {"info": info, "sections": sections, "figures": [h for d in GRIDS for h in sections.get(d, [])],
            "multiples": relation_multiples(by_relation, headline), "multiples_sweep": multiples_sweep,
            "rejections": queries.rejections(con, run_id), "metrics": metrics, "headline": headline,
            "n_effects": queries.effect_rows(con, run_id)}
