"""The example everyone starts from, on the real pretrained model (smollm2-135m, bf16)."""
from __future__ import annotations

import pytest

from patchgrid.patching import PairError, recovery, sweep_pair, tokenize_pair
from tests.conftest import needs_vllm

CLEAN, CORRUPT = "The capital of France is", "The capital of Germany is"


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


def test_pair_checks(tokenizers):
    tok = tokenizers("tiny-llama")
    with pytest.raises(PairError, match="different lengths"):
        tokenize_pair(tok, CLEAN, "The capital of the United Kingdom is", " Paris", " London")
    with pytest.raises(PairError, match="--corrupt-answer ' Londonderry' is"):
        tokenize_pair(tok, CLEAN, CORRUPT, " Paris", " Londonderry")
