"""Edge attribution: every edge of the model's graph (patchgrid.graph) scored for every pair by EAP
or EAP-IG (patchgrid.edge_attribution), from gradients on the run's attributor; one row per pair
and edge (per pair, edge and position with edge_positions `each`).

An edge row is an estimate with a receiver: `sender` and `receiver` name its ends (graph's names),
`site`, `layer` and `head` say the sender again (the input: resid_pre at layer 0; a head: head; an
MLP: mlp_out), `estimate` holds its score on `metric` (logprob_diff: the log-probability difference
of the answers, each summed over its tokens; for one-token answers the logit difference), and
`position` the position (NULL: summed over the prompt's positions). Its prepare phase computes the
scores; it makes no patched run of its own.
"""
from __future__ import annotations

from ..cache import CacheSpec
from ..graph import INPUT, unsplittable
from .base import SweepKind


def sender_columns(sender: str) -> dict:
    """The site, layer and head an edge row gives its sender by."""
    if sender == INPUT:
        return {"site": "resid_pre", "layer": 0, "head": None}
    site, layer, *head = sender.split(".")
    return {"site": site, "layer": int(layer), "head": int(head[0]) if head else None}


class EdgeSweep(SweepKind):
    name, drawing = "edges", "edges"
    # the EAP objective, whatever the pair's answers (as atp's): log p(clean) - log p(corrupt), each summed
    # over its tokens, which for one-token answers is the logit difference
    metric = "logprob_diff"
    settings = ("edge_method", "ig_steps", "edge_positions", "atp_device", "atp_dtype")

    def needs(self, ctx):
        return CacheSpec(())  # the gradient model reads the prompts, not the cache

    def family_refusal(self, family):
        return unsplittable(family)

    def cells(self, pair, ctx):
        return []

    def count(self, pair, ctx):
        return 0

    def prepare(self, ctx, run):
        """Every pair's edge scores on the run's attributor (atp's: an Attributor, or the options of
        one on the engine's model)."""
        from ..attribution import attributor_for
        from ..edge_attribution import edge_scorer_for

        given = run.attributor
        attributor = attributor_for(run.engine, **(given or {})) if given is None or isinstance(given, dict) else given
        scorer = edge_scorer_for(attributor)  # a family refused by family_refusal raises GraphError here
        config = ctx.config
        scores = scorer.scores(run.pairs, config.edge_method, config.ig_steps, config.edge_positions == "each")
        edges = scorer.graph.edges
        senders, receivers = scorer.graph.senders, scorer.graph.receivers
        return ctx.with_prepared(self.name, {
            "edges": [(senders[i], receivers[j]) for i, j in edges],
            "index": ([i for i, _ in edges], [j for _, j in edges]),
            "scores": {p.pair_id: s for p, s in zip(run.pairs, scores)},
        })

    def rows(self, pair, readings, baseline, ctx):
        got = ctx.prepared_by(self.name)
        scores = got["scores"][pair.pair_id]
        rows_i, cols_j = got["index"]
        common = {"pair_id": pair.pair_id, "relation": pair.relation, "sweep": self.name, "direction": "denoise",
                  "metric": self.headline(pair)}
        ends = [(s, r, sender_columns(s)) for s, r in got["edges"]]
        if scores.dim() == 2:
            values = scores[rows_i, cols_j].tolist()
            return [{**common, **cols, "position": None, "position_role": "all", "sender": s, "receiver": r,
                     "estimate": v} for (s, r, cols), v in zip(ends, values)]
        out = []
        for t, per in enumerate(scores):
            role = pair.roles[t]
            values = per[rows_i, cols_j].tolist()
            out += [{**common, **cols, "position": t, "position_role": role, "sender": s, "receiver": r,
                     "estimate": v} for (s, r, cols), v in zip(ends, values)]
        return out

    def headline(self, pair) -> str:
        return self.metric
