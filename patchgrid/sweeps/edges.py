"""Edge attribution: every edge of the model's graph (patchgrid.methods.graph) scored for every pair by EAP
or EAP-IG (patchgrid.methods.edge_attribution), from gradients on the run's attributor; one row per pair
and edge (per pair, edge and position with edge_positions `each`). Then, per pair, the
`verify_top` edges with the largest |score| and `verify_random` sampled from the rest (seeded by
the study's seed and the pair) are patched exactly on the engine by path patching (the paths
kind's two passes, MLPs frozen: the edge alone carries the clean value): the sender patched clean
and everything after it frozen at its corrupt value, then the receiver's input (a head's q, k or v;
an MLP's neurons, computed from the stream that pass made) patched from that pass; a sender ->
logits edge is that first pass's reading.

An edge row is an estimate with a receiver: `sender` and `receiver` name its ends (graph's names),
`site`, `layer` and `head` say the sender again (the input: resid_pre at layer 0; a head: head; an
MLP: mlp_out), `estimate` holds its score on `metric` (logprob_diff: the log-probability difference
of the answers, each summed over its tokens; for one-token answers the logit difference), and
`position` the position (NULL: summed over the prompt's positions). A row patched exactly has
`verify` (top or random) and the patched run's readings, effect and recovery, as atp's rows.
"""
from __future__ import annotations

import dataclasses
import random
import zlib

from ..cache import CacheSpec, layer_keys, stream_keys
from ..methods.graph import INPUT, unsplittable
from ..metrics import Reading
from ..model.sites import LOGITS
from ..rows.effects import effect_row
from .base import Cell, SweepKind, as_runs, baselines


def sender_columns(sender: str) -> dict:
    """The site, layer and head an edge row gives its sender by."""
    if sender == INPUT:
        return {"site": "resid_pre", "layer": 0, "head": None}
    site, layer, *head = sender.split(".")
    return {"site": site, "layer": int(layer), "head": int(head[0]) if head else None}


class EdgeSweep(SweepKind):
    ablatable_why = "its scores are first order in the clean - corrupt difference"
    name, drawing, row_shape = "edges", "edges", "edge"
    # the EAP objective, whatever the pair's answers (as atp's): log p(clean) - log p(corrupt), each summed
    # over its tokens, which for one-token answers is the logit difference
    metric = "logprob_diff"
    settings = ("edge_method", "ig_steps", "edge_positions", "verify_top", "verify_random", "atp_device",
                "atp_dtype")

    def __init__(self, kinds: dict):
        self.kinds = kinds  # the registry: the paths kind patches the chosen edges exactly

    def family_refusal(self, family):
        return unsplittable(family)

    def headline(self, pair) -> str:
        return self.metric

    @staticmethod
    def verifies(config) -> bool:
        return config.verify_top + config.verify_random > 0

    def inner(self, ctx):
        """The context the paths kind patches edges in: MLPs frozen, so that an edge is a direct path."""
        return dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, path_mlps="frozen"))

    def needs(self, ctx):
        """Nothing for the scores (the gradient model reads the prompts); for exact confirmation,
        what path patching reads: the senders' clean outputs, the corrupt run's attention and MLP
        outputs it freezes, and with start_midstack the streams."""
        if not self.verifies(ctx.config):
            return CacheSpec(())
        n = ctx.n_layers
        clean = ("resid_pre.0",) + layer_keys("head", n) + layer_keys("mlp_out", n)
        streams = stream_keys(n) if ctx.config.start_midstack else ()
        return CacheSpec(clean, ("clean",), (("corrupt", layer_keys("attn_out", n) + layer_keys("mlp_out", n)
                                              + streams),))

    # ---- the scores, the choice, and the first pass ----
    def prepare(self, ctx, run):
        """Every pair's edge scores on the run's attributor (atp's: an Attributor, or the options of
        one on the engine's model); the edges patched exactly, and their first pass."""
        from ..methods.attribution import attributor_for
        from ..methods.edge_attribution import edge_scorer_for

        given = run.attributor
        attributor = attributor_for(run.engine, **(given or {})) if given is None or isinstance(given, dict) else given
        scorer = edge_scorer_for(attributor)  # a family refused by family_refusal raises GraphError here
        config = ctx.config
        scores = scorer.scores(run.pairs, config.edge_method, config.ig_steps, config.edge_positions == "each")
        graph = scorer.graph
        got = {"edges": [(graph.senders[i], graph.receivers[j]) for i, j in graph.edges],
               "index": ([i for i, _ in graph.edges], [j for _, j in graph.edges]),
               "scores": {p.pair_id: s for p, s in zip(run.pairs, scores)}, "verify": {}, "first": {}}
        ctx = ctx.with_prepared(self.name, got)
        if not self.verifies(config):
            return ctx
        for p in run.pairs:
            got["verify"][p.pair_id] = self.chosen(p, ctx)
        return self.first_pass(ctx, run)

    def edge_cells(self, pair, ctx) -> list[tuple[Cell, float]]:
        """Every (edge, position) of the pair as a cell (receiver set), with its score."""
        got = ctx.prepared_by(self.name)
        scores = got["scores"][pair.pair_id]
        rows_i, cols_j = got["index"]
        per = [(None, scores)] if scores.dim() == 2 else list(enumerate(scores))
        out = []
        for position, s in per:
            values = s[rows_i, cols_j].tolist()
            out += [(Cell(self.name, receiver=r, position=position, **sender_columns(sndr)), v)
                    for (sndr, r), v in zip(got["edges"], values)]
        return out

    def chosen(self, pair, ctx) -> dict[Cell, str]:
        """The cells patched exactly: the top `verify_top` by |score|, then `verify_random` sampled
        (seeded by the study seed and the pair) from the rest; cell -> `top` or `random`."""
        config = ctx.config
        ranked = sorted(self.edge_cells(pair, ctx), key=lambda cv: -abs(cv[1]))  # stable: graph order on ties
        top, rest = ranked[:config.verify_top], [c for c, _ in ranked[config.verify_top:]]
        rng = random.Random(zlib.crc32(f"{config.seed}:{pair.pair_id}:edges".encode()))
        out = {c: "top" for c, _ in top}
        out.update({c: "random" for c in rng.sample(rest, min(config.verify_random, len(rest)))})
        return out

    def first_pass(self, ctx, run):
        """Path patching's first pass for the chosen edges: per pair, sender and position, the sender
        patched clean and what follows it frozen, capturing what the chosen receivers read."""
        paths, inner, got = self.kinds["paths"], self.inner(ctx), ctx.prepared_by(self.name)
        derived, runs = {}, []
        for i, p in enumerate(run.pairs):
            first = got["first"].setdefault(p.pair_id, {})
            change, as_run = self.first_change(p), as_runs(i, ctx, self.metrics_read(p, ctx.config))
            receivers: dict[Cell, list[str]] = {}
            for cell in got["verify"][p.pair_id]:
                receivers.setdefault(dataclasses.replace(cell, receiver=None), []).append(cell.receiver)
            for cell, ends in receivers.items():
                if ctx.config.start_midstack and self.unchanged(cell, change):
                    continue  # its edges equal the corrupt run (the runner fills them in)
                if paths.direct_path_is_zero(cell, p):
                    first[cell] = baselines(run.store.baselines[p.pair_id])[1]
                req = paths.first_request(p, cell, inner, f"{i}:clean", f"{i}:corrupt", ends)
                if req.capture or cell not in first:
                    runs.append((i, self, cell, as_run(req, cell)))

        def read(r, res):
            i, _, cell, _ = r
            got["first"][run.pairs[i].pair_id].setdefault(cell, Reading.of(res))
            derived[(run.pairs[i].pair_id, paths.first_run(cell))] = res.captures

        run.run(runs, read, ctx)
        return ctx.with_prepared(self.name, got, derived)

    # ---- the grid: the chosen edges' second pass ----
    def cells(self, pair, ctx):
        got = ctx.prepared_by(self.name)
        if got is None or not got["verify"]:
            return []
        return list(got["verify"][pair.pair_id])

    def count(self, pair, ctx):
        """The edges patched exactly: verify_top + verify_random per pair, or every edge where there
        are fewer (counted for a block that is not parallel)."""
        if not self.verifies(ctx.config):
            return 0
        got = ctx.prepared_by(self.name)
        if got is not None and got["verify"]:
            return len(got["verify"][pair.pair_id])
        from ..methods.graph import EdgeGraph

        graph = EdgeGraph(ctx.n_layers, ctx.n_heads, ctx.n_kv_heads or ctx.n_heads, False)
        per = len(pair.corrupt_ids) if ctx.config.edge_positions == "each" else 1
        return min(ctx.config.verify_top + ctx.config.verify_random, len(graph.edges) * per)

    def source_run(self, cell):
        return self.kinds["paths"].source_run(cell)

    def reading_without_run(self, cell, ctx, pair):
        if cell.receiver == LOGITS:
            return ctx.prepared_by(self.name)["first"][pair.pair_id].get(dataclasses.replace(cell, receiver=None))
        return None

    def request(self, pair, cell, ctx, source):
        return self.kinds["paths"].request(pair, cell, self.inner(ctx), source)

    # ---- rows ----
    def rows(self, pair, readings, baseline, ctx):
        exact = dict(readings)
        clean, corrupt = baselines(baseline) if exact else (None, None)
        verify = (ctx.prepared_by(self.name)["verify"] or {}).get(pair.pair_id, {})  # cell -> top or random
        common = {"pair_id": pair.pair_id, "relation": pair.relation, "sweep": self.name, "direction": "denoise",
                  "metric": self.metric}
        out = []
        got = ctx.prepared_by(self.name)
        senders = [s for s, _ in got["edges"]]  # edge_cells' order: every edge, position by position
        circuit = ctx.prepared_by("circuit")  # the circuit kind's order of the edges, when it runs
        for k, (cell, score) in enumerate(self.edge_cells(pair, ctx)):
            sender = senders[k % len(senders)]
            if cell in exact:
                row = effect_row(pair, cell, exact[cell], clean, corrupt, self.metric)
                row.update(sender=sender, estimate=score, verify=verify[cell])
            else:
                row = {**common, "site": cell.site, "layer": cell.layer, "head": cell.head,
                       "position": cell.position,
                       "position_role": "all" if cell.position is None else pair.roles[cell.position],
                       "sender": sender, "receiver": cell.receiver, "estimate": score}
            if circuit is not None:
                row["circuit_rank"] = circuit["rank"][k % len(senders)]
            out.append(row)
        return out
