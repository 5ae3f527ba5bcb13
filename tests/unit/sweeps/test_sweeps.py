"""Sweeps over many pairs: equal to the reference backend, chunk-independent, deterministic."""
from __future__ import annotations

import pytest

from patchgrid.sweeps import SWEEP_KINDS, SweepConfig, trace_window


def test_engine_calls_are_cut_where_a_start_layer_ends():
    from types import SimpleNamespace

    from patchgrid.sweeps.run import start_layer_calls

    def run(layer):
        return (0, None, None, SimpleNamespace(start=SimpleNamespace(layer=layer) if layer else None))

    runs = [run(layer) for layer in (3, 0, 3, 1, 3, 0, 3, 3, 3, 1)]
    calls = start_layer_calls(runs, 4)
    layers = [[r[-1].start.layer if r[-1].start else 0 for r in call] for call in calls]
    assert layers == [[0, 0, 1, 1], [3, 3, 3, 3], [3, 3]]  # layer 3's six runs split only by the size
    assert sorted(map(id, sum(calls, []))) == sorted(map(id, runs))
    assert start_layer_calls(runs, 100) == [sum(calls, [])] and start_layer_calls([], 4) == []


def test_trace_window_is_centred_and_cut():
    assert list(trace_window(0, 10, 30)) == list(range(0, 5))
    assert list(trace_window(15, 10, 30)) == list(range(10, 20))
    assert list(trace_window(29, 10, 30)) == list(range(24, 30))


def test_bad_configuration():
    with pytest.raises(ValueError, match="unknown sweep 'everything'"):
        SweepConfig(sweeps=("everything",))
    with pytest.raises(ValueError, match="unknown direction 'sideways'"):
        SweepConfig(resid_directions=("sideways",))
    with pytest.raises(ValueError, match="unknown trace site"):
        SweepConfig(trace_sites=("embed",))


def test_trace_noise_is_meng_et_al_s_over_the_data_set(tokenizers):
    """3 x the std of the subjects' token embeddings, each subject tokenized alone: the same for any
    subset of pairs a study keeps, and equal to the embedding matrix read by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from patchgrid.model.models import prepare
    from patchgrid.pairs import read_source
    from patchgrid.pipeline.spec import StudySpec
    from patchgrid.sweeps import subject_noise
    from patchgrid.tasks.sweeps import measure_trace_noise
    from tests.support.pairs import DATA

    _, records = read_source(str(DATA))
    subjects = [r.subject for r in records]
    tok = tokenizers("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(prepare("tiny-llama"), dtype=torch.float32)
    weight = model.get_input_embeddings().weight.detach()
    ids = [i for s in subjects for i in tok(s, add_special_tokens=False).input_ids]
    expected = 3 * float(weight[torch.tensor(ids)].std())
    noise = subject_noise(prepare("tiny-llama"), subjects, 3.0)
    assert noise.std == pytest.approx(expected, rel=1e-5) and f"{len(subjects)} subjects" in noise.source
    # what a study measures depends on the data set and the model, not on --limit or --require-known
    from prefect.logging import disable_run_logger

    with disable_run_logger():
        few = measure_trace_noise.fn(StudySpec(model="tiny-llama", pairs=str(DATA), limit=2), "sha")
        many = measure_trace_noise.fn(StudySpec(model="tiny-llama", pairs=str(DATA), limit=50, require_known=False),
                                      "sha")
    assert few == many and few.std == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("head_positions", ["roles", "every"])
def test_each_kind_counts_its_cells(head_positions):
    from patchgrid.sweeps import SweepContext
    from tests.support.effect_rows import make_pair

    pair = make_pair("p", ["before_subject", "subject_first", "subject_last", "further", "last"], subject=(1, 3))
    configs = [SweepConfig(sweeps=("resid",), head_positions=head_positions, trace_samples=2),
               SweepConfig(sweeps=("resid",), head_positions=head_positions, trace_samples=2, layers=(0, 2),
                           positions=(1, 4), resid_directions=("denoise", "noise"))]
    for config in configs:
        ctx = SweepContext(config, n_layers=3, n_heads=2, d_mlp=5)
        for name, kind in SWEEP_KINDS.items():
            # atp's and edges' cells are chosen by their estimates (tests/engine/methods/test_attribution.py
            # and test_edge_attribution.py count them)
            if name not in ("atp", "edges"):
                assert kind.count(pair, ctx) == len(kind.cells(pair, ctx)), (name, config.layers)

