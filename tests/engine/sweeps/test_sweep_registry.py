"""The sweep registry is the one extension point: a kind registered there (a class and its entry), its
settle and prepare phases included, runs through run_sweeps on an engine with no other change, and
its rows are the same runs as the resid sweep's cells it repeats."""
from __future__ import annotations

import pytest

from patchgrid.cache import CacheSpec, MemoryStore, layer_keys, stream_keys
from patchgrid.plan import Patch, Request
from patchgrid.sweeps import (
    SWEEP_KINDS,
    Cell,
    SweepConfig,
    SweepKind,
    cache_spec,
    run_sweeps,
)
from patchgrid.sweeps.base import scored
from tests.support.pairs import shipped_pairs


class LastPosition(SweepKind):
    """resid patched clean into corrupt at the prompt's last position, layer by layer; its prepare
    phase hands each pair's layers to the grid, and the top layer's reading comes from the phase."""

    name = "last_position"

    def __init__(self):
        self.phases = []

    def needs(self, ctx):
        streams = (("corrupt", stream_keys(ctx.n_layers)),) if ctx.config.start_midstack else ()
        return CacheSpec(layer_keys("resid", ctx.n_layers), ("clean",), streams)

    def settle(self, ctx, run):
        self.phases.append("settle")
        return ctx

    def prepare(self, ctx, run):
        self.phases.append("prepare")
        return ctx.with_prepared(self.name, {p.pair_id: list(range(ctx.n_layers)) for p in run.pairs})

    def cells(self, pair, ctx):
        return [Cell(self.name, "resid", "denoise", layer, len(pair.clean_ids) - 1)
                for layer in ctx.prepared_by(self.name)[pair.pair_id]]

    def count(self, pair, ctx):
        return ctx.n_layers

    def request(self, pair, cell, ctx, source):
        return Request(tokens=pair.corrupt_ids, patches=(Patch("resid", cell.layer, source, (cell.position,)),),
                       **scored(pair))


def test_a_kind_registered_once_runs_through_run_sweeps(engines, tokenizers, monkeypatch):
    hf = engines.get("tiny-llama", "hf", dtype="float32")
    pairs = shipped_pairs(tokenizers("tiny-llama"), 2)
    kind = LastPosition()
    monkeypatch.setitem(SWEEP_KINDS, kind.name, kind)
    # the sweeps setting's choices are the registry's, asked when a config is built
    config = SweepConfig(sweeps=("resid", kind.name), resid_directions=("denoise",))
    store = MemoryStore(hf, pairs, cache_spec(config, hf.shape.n_layers))
    rows = run_sweeps(hf, pairs, store, config)
    assert kind.phases == ["settle", "prepare"]
    mine = {(r["pair_id"], r["layer"]): r for r in rows if r["sweep"] == kind.name}
    assert len(mine) == len(pairs) * hf.shape.n_layers
    # the same runs as the resid sweep's cells at the last position
    last = {p.pair_id: len(p.clean_ids) - 1 for p in pairs}
    resid = [r for r in rows if r["sweep"] == "resid" and r["position"] == last[r["pair_id"]]]
    assert len(resid) == len(mine)
    for r in resid:
        got = mine[(r["pair_id"], r["layer"])]
        assert got["patched_logit_diff"] == pytest.approx(r["patched_logit_diff"], abs=1e-5)
        assert got["recovery"] == pytest.approx(r["recovery"], abs=1e-5)

