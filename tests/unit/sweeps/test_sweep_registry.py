"""What the sweep registry declares of its kinds, read without an engine: every kind the effect rows
name is registered, its population, drawing, settings and row shape ones the rest of patchgrid knows;
and what the kinds of a run declare together (their settings, their populations, whether aligning asks
the model, whether a run is noised). A kind registered there running through run_sweeps:
tests/engine/sweeps/test_sweep_registry.py."""
from __future__ import annotations

from patchgrid.pipeline.spec import StudySpec
from patchgrid.rows.shapes import ROW_SHAPES, SWEEP_NAMES
from patchgrid.sweeps import (
    POPULATIONS,
    SWEEP_KINDS,
    SweepConfig,
    aligning_asks_model,
    by_population,
    noised,
    settings_of,
)


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

