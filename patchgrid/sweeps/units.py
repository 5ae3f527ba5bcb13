"""Unit sweeps: one unit per run (an attention head's slice of z, or of q, k or v, or one MLP
neuron), at every position at once and at chosen roles' positions, or at each position.

    heads     layer x head: every position at once, and at chosen positions (by role)
    neurons   layer x MLP neuron, at the same positions as heads (exhaustive only on small models;
              the atp sweep screens them)
    qkv       layer x head x position for each of q, k and v (k and v by key/value head), at the
              same positions as heads
"""
from __future__ import annotations

from ..cache import CacheSpec, layer_keys, stream_keys
from ..model.sites import SITES
from ..plan import Patch, Request
from .base import Cell, SweepKind, grid_layers, scored, unit_positions


class UnitSweep(SweepKind):
    """One unit (an attention head's slice of z or of q, k or v, or one MLP neuron) per run: at every
    position at once and at the positions of chosen roles, or at every (or given) position one by
    one. A kind may patch several sites (qkv: q, k and v), each unit by unit."""
    ablatable = True

    def __init__(self, name: str, *sites: str, drawing: str = "layer_by_head"):
        self.name, self.sites, self.drawing = name, sites, drawing
        self.site = sites[0]  # the site a single-site kind patches (atp screens by it)

    def needs(self, ctx):
        streams = (("corrupt", stream_keys(ctx.n_layers)),) if ctx.config.start_midstack else ()
        keys = tuple(k for site in self.sites for k in layer_keys(site, ctx.n_layers))
        return CacheSpec(keys, ("clean",), streams)

    def positions(self, pair, config) -> list[int | None]:
        return unit_positions(pair, config)

    @staticmethod
    def units(site: str, ctx) -> int:
        unit = SITES[site].unit
        n = {"head": ctx.n_heads, "kv_head": ctx.n_kv_heads or ctx.n_heads, "neuron": ctx.d_mlp}[unit]
        if not n:
            raise ValueError(f"a sweep over {site} needs the model's number of {unit}s")
        return n

    def cells(self, pair, ctx):
        return [Cell(self.name, site, "denoise", layer, pos, **{SITES[site].unit_field: unit})
                for site in self.sites for pos in self.positions(pair, ctx.config) for layer in grid_layers(ctx)
                for unit in range(self.units(site, ctx))]

    def count(self, pair, ctx):
        per_layer = len(self.positions(pair, ctx.config)) * sum(self.units(s, ctx) for s in self.sites)
        return len(grid_layers(ctx)) * per_layer

    def request(self, pair, cell, ctx, source):
        positions = None if cell.position is None else (cell.position,)
        field = SITES[cell.site].unit_field
        return Request(tokens=pair.corrupt_ids,
                       patches=(Patch(cell.site, cell.layer, source, positions, **{field: getattr(cell, field)}),),
                       **scored(pair))
