"""Position sweeps: one site patched at one (layer, position) per run.

    resid     layer x position; denoise (clean into corrupt) and noise (corrupt into clean)
    resid_pre layer x position, denoise: the stream entering each layer (layer 0: the embedding)
    resid_mid layer x position, denoise: the stream between each layer's attention and MLP
    attn_out  layer x position, denoise
    mlp_out   layer x position, denoise
    embed     position, denoise (the token embedding: a patch is a token swap)
"""
from __future__ import annotations

from ..cache import CacheSpec, layer_keys, stream_keys
from ..plan import Patch, Request
from .base import Cell, SweepKind, every_position, grid_layers, scored


def prompt_into(pair, direction: str):
    """The prompt a patch goes into: corrupt when denoising, clean when noising."""
    return pair.corrupt_ids if direction == "denoise" else pair.clean_ids


class PositionSweep(SweepKind):
    """One site patched at one (layer, position) per run."""
    ablatable = True

    def __init__(self, site: str, *, layered: bool = True, both_directions: bool = False):
        self.name = self.site = site
        self.sites = (site,)
        self.layered, self.both_directions = layered, both_directions

    def directions(self, config) -> tuple[str, ...]:
        return config.resid_directions if self.both_directions else ("denoise",)

    def needs(self, ctx):
        config = ctx.config
        keys = layer_keys(self.site, ctx.n_layers) if self.layered else ("embed",)
        runs = ("clean", "corrupt") if "noise" in self.directions(config) else ("clean",)
        streams = ()
        if config.start_midstack and self.layered:  # the embedding patch starts at the embedding
            streams = tuple((Cell(self.name, self.site, d).base_run, stream_keys(ctx.n_layers))
                            for d in self.directions(config))
        return CacheSpec(keys, runs, streams)

    def cells(self, pair, ctx):
        layers = grid_layers(ctx) if self.layered else [None]
        positions = every_position(pair, ctx.config)
        return [Cell(self.name, self.site, direction, layer, pos)
                for direction in self.directions(ctx.config) for layer in layers for pos in positions]

    def count(self, pair, ctx):
        """len(cells), without making them (count_runs asks before the grid is made)."""
        layers = len(grid_layers(ctx)) if self.layered else 1
        return len(self.directions(ctx.config)) * layers * len(every_position(pair, ctx.config))

    def request(self, pair, cell, ctx, source):
        return Request(tokens=prompt_into(pair, cell.direction),
                       patches=(Patch(self.site, cell.layer, source, (cell.position,)),), **scored(pair))
