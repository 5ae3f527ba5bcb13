"""The sweep registry is the one extension point: a kind registered there (a class and its entry)
runs through run_sweeps, phases included, with no other change; what kinds declare is read from
it (settings, populations, the model asked when aligning)."""
from __future__ import annotations

import pytest

from patchgrid.cache import CacheSpec, MemoryStore, layer_keys, stream_keys
from patchgrid.pipeline.spec import StudySpec
from patchgrid.plan import Patch, Request
from patchgrid.rows.shapes import ROW_SHAPES, SWEEP_NAMES
from patchgrid.sweeps import (
    POPULATIONS,
    SWEEP_KINDS,
    Cell,
    SweepConfig,
    SweepKind,
    aligning_asks_model,
    by_population,
    cache_spec,
    noised,
    run_sweeps,
    settings_of,
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


def test_the_registry_lists_every_kind_the_rows_name():
    assert tuple(SWEEP_KINDS) == SWEEP_NAMES
    for name, kind in SWEEP_KINDS.items():
        assert kind.name == name and kind.population in POPULATIONS
        assert kind.drawing in ("layer_by_role", "layer_by_head", "none", "trace_buckets", "paths", "atp", "edges",
                                "circuit", "knockout")
        assert set(kind.settings) <= set(SweepConfig.__dataclass_fields__) | set(StudySpec.__dataclass_fields__), name
        assert kind.row_shape in ROW_SHAPES, name  # the shape of its effect rows, which the warehouse files them by


def test_what_the_kinds_of_a_run_declare_together():
    assert settings_of(("resid", "heads")) == ()
    assert settings_of(("resid", "heads", "trace")) == ("trace_samples", "trace_window", "trace_noise_scale",
                                                        "trace_sites", "trace_facts")
    assert settings_of(("paths", "atp", "resid")) == ("path_senders", "path_receivers", "path_inputs", "path_mlps",
                                                      "atp_kinds", "verify_top", "verify_random", "atp_correction",
                                                      "atp_qk_fix", "atp_device", "atp_dtype")
    groups = by_population(("trace", "resid", "atp"))
    assert [(p.name, names) for p, names in groups] == [("accepted_pairs", ("resid", "atp")),
                                                         ("traced_facts", ("trace",))]
    assert aligning_asks_model(("trace",)) and not aligning_asks_model(("resid", "atp", "paths"))
    assert noised(("resid", "trace")) and not noised(("resid", "paths"))
