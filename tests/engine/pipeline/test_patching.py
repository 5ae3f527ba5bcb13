"""The example everyone starts from, on the real pretrained model (smollm2-135m, bf16)."""
from __future__ import annotations

import pytest

from patchgrid.pipeline.one_pair import recovery, sweep_pair, tokenize_pair
from tests.support.engines import needs_vllm
from tests.unit.pipeline.test_patching import CLEAN, CORRUPT


@pytest.fixture(scope="module")
def france(tokenizers):
    return tokenize_pair(tokenizers("smollm2-135m"), CLEAN, CORRUPT, " Paris", " Berlin")


def _grid(out):
    return {(e["layer"], e["position"]): recovery(e["logit_diff"], out["baseline"]) for e in out["effects"]}


@pytest.mark.slow
@needs_vllm
def test_resid_recovery_moves_from_subject_to_last_position(engines, france):
    engine = engines.get("smollm2-135m", "vllm")
    out = sweep_pair(engine, france, "resid")
    base = out["baseline"]
    assert base["clean"] > 2 and base["corrupt"] < -2  # the model knows both capitals
    grid = _grid(out)
    subject, last, n = 3, 4, engine.shape.n_layers
    early, late = range(0, n // 3), range(n - 4, n)
    assert min(grid[layer, subject] for layer in early) > 0.8
    assert max(grid[layer, subject] for layer in late) < 0.2
    assert max(grid[layer, last] for layer in early) < 0.2
    assert min(grid[layer, last] for layer in late) > 0.8
    # positions before the subject carry nothing that differs (bf16 kernels may round rows
    # differently in different batches, hence not exactly zero)
    assert all(abs(grid[layer, 0]) < 0.02 for layer in range(n))


@pytest.mark.slow
@needs_vllm
def test_bf16_vllm_agrees_with_hf_on_the_pretrained_model(engines, france):
    v = _grid(sweep_pair(engines.get("smollm2-135m", "vllm"), france, "resid"))
    h = _grid(sweep_pair(engines.get("smollm2-135m", "hf"), france, "resid"))
    # bf16 kernels differ between the backends; the recoveries must not.
    assert max(abs(v[k] - h[k]) for k in v) < 0.1


def test_patch_scores_answers_of_several_tokens(engines, tokenizers):
    """A pair whose answers are scored whole has no logit difference: `patchgrid patch` reports the
    log-probability difference, and its recovery, on every cell."""
    engine = engines.get("tiny-llama", "hf", dtype="float32")
    tokens = tokenize_pair(tokenizers("tiny-llama"), CLEAN, CORRUPT, " Paris", " Londonderry")
    out = sweep_pair(engine, tokens, "resid", [3, len(tokens.clean) - 1])
    base = out["baseline"]
    assert base["metric"] == "logprob_diff" and base["runs"]["clean"]["logit_diff"] is None
    assert base["clean"] == pytest.approx(base["runs"]["clean"]["logp_clean"] - base["runs"]["clean"]["logp_corrupt"])
    for e in out["effects"]:
        assert e["logit_diff"] is None and e["kl"] >= 0
        assert e["recovery"] == pytest.approx(recovery(e["logprob_diff"], base), abs=1e-6)


@pytest.mark.parametrize("site, sweep", [("resid", "resid"), ("head", "heads"), ("embed", "embed"),
                                         ("mlp_out", "mlp_out"), ("neuron", "neurons"), ("resid_pre", "resid_pre"),
                                         ("resid_mid", "resid_mid"), ("k", "qkv")])
def test_patch_runs_the_study_sweep(tmp_path, engines, tokenizers, site, sweep):
    """`patchgrid patch` and a study's sweep of the same pair give the same numbers: one code path."""
    from patchgrid.cache import load_or_build
    from patchgrid.pipeline.one_pair import as_pair
    from patchgrid.sweeps import SweepConfig, cache_spec, run_sweeps

    engine = engines.get("tiny-llama", "hf", dtype="float32")
    tokens = tokenize_pair(tokenizers("tiny-llama"), CLEAN, CORRUPT, " Paris", " Berlin")
    positions = [1, len(tokens.clean) - 1]
    out = sweep_pair(engine, tokens, site, positions)
    config = SweepConfig(sweeps=(sweep,), resid_directions=("denoise",), positions=tuple(positions))
    cache, _ = load_or_build(engine, [as_pair(tokens)], cache_spec(config, 4), tmp_path, log=lambda *_: None)
    rows = [r for r in run_sweeps(engine, [as_pair(tokens)], cache, config) if r["site"] == site]
    units = {"head": 4, "neuron": engine.shape.d_mlp, "k": engine.shape.kv_heads}.get(site, 1)
    assert len(out["effects"]) == len(rows) == (1 if site == "embed" else 4) * units * 2
    for e, r in zip(out["effects"], rows):
        assert (e["site"], e["layer"], e["head"], e["neuron"], e["position"]) == \
            (r["site"], r["layer"], r["head"], r["neuron"], r["position"])
        assert e["logit_diff"] == pytest.approx(r["patched_logit_diff"], abs=1e-6)
        assert recovery(e["logit_diff"], out["baseline"]) == pytest.approx(r["recovery"], abs=1e-4)


def test_the_patch_table_of_neurons_shows_those_that_move_the_metric_most(engines, tokenizers):
    from patchgrid.runtime.console import NEURON_ROWS, format_patch_table

    engine = engines.get("tiny-llama", "hf", dtype="float32")
    tokens = tokenize_pair(tokenizers("tiny-llama"), CLEAN, CORRUPT, " Paris", " Berlin")
    out = sweep_pair(engine, tokens, "neuron", [len(tokens.clean) - 1])
    table = format_patch_table(out, ["t"] * len(tokens.clean)).splitlines()
    rows = table[4:]
    assert table[2] == f"(the {NEURON_ROWS} of {4 * engine.shape.d_mlp} neurons that move it most)"
    assert len(rows) == NEURON_ROWS and rows[0].split()[0].count(".") == 1
    moved = sorted((abs(e["logit_diff"] - out["baseline"]["corrupt"]) for e in out["effects"]), reverse=True)
    assert abs(float(rows[0].split()[1]) - out["baseline"]["corrupt"]) == pytest.approx(moved[0], abs=2e-3)
    assert moved[0] > 1e-3

