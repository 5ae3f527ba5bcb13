"""Attention knockout (Geva et al. 2023, "Dissecting Recall of Factual Associations in Auto-Regressive
Language Models"): on the clean prompt of a fact the model knows, the last position may not read a
group of positions, in every head, over a window of layers centred on each layer; the blocked scores
are set to minus infinity before the softmax (plan.Knockout). The groups, by position:

    subject      the subject's tokens
    non_subject  every token but the subject's and the last
    last         the last token itself

A group a prompt has no position of (non_subject, where the subject runs up to the last token) has
no cell for it. The headline metric is the answer's probability (its first token's when the answer
has one, the whole answer's otherwise), as theirs; each row holds every metric, and the views give
the relative change in percent, Geva et al.'s measure, with intervals (knockout_curve).
"""
from __future__ import annotations

from ..cache import CacheSpec, stream_keys
from ..plan import Knockout, Request
from ..rows.shapes import KNOCKOUT_DIRECTION, KNOCKOUT_GROUPS, KNOCKOUT_SITE
from .base import Cell, SweepKind, grid_layers, scored, trace_window
from .populations import TRACED_FACTS


def group_positions(pair, group: str) -> tuple[int, ...]:
    """The positions of `group` in the pair's clean prompt."""
    last = len(pair.clean_ids) - 1
    subject = set(pair.subject_positions)
    return {"subject": tuple(sorted(subject)), "last": (last,),
            "non_subject": tuple(p for p in range(last) if p not in subject)}[group]


class KnockoutSweep(SweepKind):
    """The clean prompt with the last position's attention to one group of positions blocked over a
    window of layers; rows: the knocked-out run against the clean run (direction `knockout`, site
    `attention_edges`, the group in `blocked`)."""

    name, metric, drawing, row_shape = "knockout", "p", "knockout", "knockout"
    population = TRACED_FACTS
    settings = ("knockout_window",)
    sites = ()
    ablatable_why = "a knockout blocks attention edges; it patches no value"

    def needs(self, ctx):
        streams = (("clean", stream_keys(ctx.n_layers)),) if ctx.config.start_midstack else ()
        return CacheSpec((), ("clean",), streams)

    def cells(self, pair, ctx):
        last = len(pair.clean_ids) - 1
        return [Cell(self.name, KNOCKOUT_SITE, KNOCKOUT_DIRECTION, layer, last, window=ctx.config.knockout_window,
                     row_columns=(("blocked", group),))
                for group in KNOCKOUT_GROUPS if group_positions(pair, group) for layer in grid_layers(ctx)]

    def request(self, pair, cell, ctx, source):
        layers = tuple(trace_window(cell.layer, cell.window, ctx.n_layers))
        blocked = group_positions(pair, cell.row_column("blocked"))
        return Request(tokens=pair.clean_ids, knockout=Knockout(layers, (cell.position,), blocked), **scored(pair))

    @staticmethod
    def unchanged(cell, first_change):
        return False  # a knockout changes the clean run at the last position, whatever its tokens

    def rows(self, pair, readings, baseline, ctx):
        rows = super().rows(pair, readings, baseline, ctx)
        for row in rows:  # the layers actually blocked: the window is cut at the model's ends
            row["window"] = len(trace_window(row["layer"], row["window"], ctx.n_layers))
        return rows
