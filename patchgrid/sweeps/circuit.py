"""Circuits judged by faithfulness, as MIB's circuit track judges them (its `evaluate_graph` and
`evaluate_area_under_curve`): from the run's edge scores (the edges kind, which runs first), the
circuits of each size in `circuit_sizes` (percent of the graph's edges; patchgrid.methods.circuits builds
them by `circuit_build`), each run on the engine for every pair as a circuit run (plan.Circuit,
backends.edge_ablation): the clean prompt, every edge outside the circuit carrying its sender's
value from the corrupt run (`ablation` patching), the data set's mean at that position role
(mean: over the run's pairs' clean runs, as MIB's mean ablation is over clean inputs), or zero.

The circuit is one for the run: its edges are ranked by the mean over the run's pairs of each pair's
score (summed over positions where the edges were scored per position). The cells of a pair are
its circuits by size, and the empty circuit (size 0); the full circuit (100) is the clean run
exactly, and with patching the empty circuit is the corrupt run, so those are read from the
baselines, not run.

A row per pair and circuit: `circuit_size`, `circuit_edges`, `ablation`, the patched run's
readings, `metric` (logprob_diff, each answer's log-probability summed over its tokens, scored whole
as every sweep scores them; for one-token answers the logit difference, the metric MIB takes for
IOI), `effect` = m(C) - m(empty) and `recovery` = the pair's faithfulness
(m(C) - m(empty)) / (m(full) - m(empty)), NULL where the two ends are equal. The warehouse's
circuit views average these (circuit_curve, circuit_score). The edges kind's rows carry
`circuit_rank`, each edge's place in the order, so that circuit_edges lists every circuit's edges.
"""
from __future__ import annotations

from ..cache import CacheSpec
from ..methods.circuits import circuit_size, edge_order
from ..methods.graph import EdgeGraph, circuit_keys, unsplittable
from ..plan import Circuit, Request
from ..rows.effects import PairRows
from .base import Cell, SweepKind, baselines, scored, source_name


class CircuitSweep(SweepKind):
    name, drawing, row_shape = "circuit", "circuit", "circuit"
    metric = "logprob_diff"
    settings = ("circuit_sizes", "circuit_build")
    builds_on = ("edges",)
    builds_on_why = "builds its circuits from the run's edge scores"
    ablatable = True
    spans_data_set = True

    def family_refusal(self, family):
        why = unsplittable(family)
        if why is None and family.mlp_norm is None:
            why = (f"the {family.name} block is parallel (attention and MLP read one norm of the layer's input); "
                   "circuit runs are built for sequential blocks only")
        return why

    def headline(self, pair) -> str:
        return self.metric

    def needs(self, ctx):
        """The senders' outputs of the run the edges outside a circuit take theirs from (none for zero)."""
        keys = tuple(circuit_keys(ctx.n_layers))
        run = {"patching": "corrupt", "mean": "clean"}.get(ctx.config.ablation)
        return CacheSpec(()) if run is None else CacheSpec((), ("clean",), ((run, keys),))

    def prepare(self, ctx, run):
        edges = ctx.prepared_by("edges")
        graph = EdgeGraph.of(run.engine.shape)
        rows_i, cols_j = edges["index"]
        total = None
        for p in run.pairs:
            s = edges["scores"][p.pair_id]
            s = (s.sum(0) if s.dim() == 3 else s)[rows_i, cols_j].double().cpu()
            total = s if total is None else total + s
        n = len(graph.edges)
        order = edge_order(graph, total / max(len(run.pairs), 1), ctx.config.circuit_build) if total is not None \
            else list(range(n))
        rank = [0] * n
        for k, e in enumerate(order):
            rank[e] = k
        sizes = (0.0,) + tuple(ctx.config.circuit_sizes)
        got = {"rank": rank, "circuits": {s: tuple(sorted(order[:circuit_size(s, n)])) for s in sizes},
               "baselines": {p.pair_id: baselines(run.store.baselines[p.pair_id]) for p in run.pairs}}
        return ctx.with_prepared(self.name, got)

    def cell_of_size(self, size: float) -> Cell:
        """A pair's run of the circuit of `size` (percent of the graph's edges; 0: the empty circuit)."""
        return Cell(self.name, None, row_columns=(("circuit_size", size),))

    def cells(self, pair, ctx):
        return [self.cell_of_size(s) for s in (0.0,) + tuple(ctx.config.circuit_sizes)]

    def patch_source(self, index: int, cell, ctx) -> str:
        ablation = ctx.config.ablation
        return source_name(index, "clean" if ablation == "mean" else "corrupt", ablation)

    def reading_without_run(self, cell, ctx, pair):
        """The full circuit is the clean run; with patching, the empty circuit is the corrupt run."""
        clean, corrupt = ctx.prepared_by(self.name)["baselines"][pair.pair_id]
        size = cell.row_column("circuit_size")
        if size == 100:
            return clean
        if size == 0 and ctx.config.ablation == "patching":
            return corrupt
        return None

    def request(self, pair, cell, ctx, source):
        kept = ctx.prepared_by(self.name)["circuits"][cell.row_column("circuit_size")]
        return Request(pair.clean_ids, **scored(pair), circuit=Circuit(source, kept))

    def rows(self, pair, readings, baseline, ctx):
        clean, corrupt = baselines(baseline)
        metric, row_of = self.metric, PairRows(pair, clean, corrupt, self.metric).row
        circuits = ctx.prepared_by(self.name)["circuits"]
        got = dict(readings)
        empty, full = got[self.cell_of_size(0.0)].value(metric), clean.value(metric)
        out = []
        for cell, r in readings:
            row = row_of(cell, r)  # circuit_size among its columns
            value = r.value(metric)
            row.update(effect=value - empty,
                       recovery=(value - empty) / (full - empty) if full != empty else None,
                       circuit_edges=len(circuits[row["circuit_size"]]), ablation=ctx.config.ablation)
            out.append(row)
        return out
