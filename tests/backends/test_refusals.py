"""Engines refuse bad plans before running anything, and stay usable afterwards."""
from __future__ import annotations

import pytest

from patchgrid.plan import Patch, PlanError, Request
from tests.support.engines import needs_vllm


@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=needs_vllm), "hf"])
def test_engine_refuses_then_still_works(engines, backend):
    engine = engines.get("tiny-llama", backend, dtype="float32")
    good = Request(tokens=(3, 4, 5), answers=(6,))
    baseline = engine.run([good])[0].answer_logits
    bad = Request(tokens=(3, 4, 5), answers=(6,), patches=(Patch("resid", 99, "clean", (0,)),))
    with pytest.raises(PlanError, match="request 1: patch layer 99 is out of range"):
        engine.run([good, bad], {"clean": {"resid.99": None}})
    assert engine.hook_count() == 0
    assert (engine.run([good])[0].answer_logits == baseline).all()


@needs_vllm
def test_vllm_refuses_the_attention_pattern_with_the_reason(engines):
    engine = engines.get("tiny-llama", "vllm", dtype="float32")
    with pytest.raises(PlanError, match="request 0: pattern.1: the attention pattern is computed inside vLLM's fused "
                                        "attention kernels.*capture it with the hf backend"):
        engine.run([Request(tokens=(3, 4, 5), capture=("pattern.1",))])
    assert engine.hook_count() == 0


@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=needs_vllm), "hf"])
def test_the_pattern_and_bad_units_of_q_k_v_are_refused_as_patches(engines, backend):
    engine = engines.get("tiny-llama", backend, dtype="float32")
    src = {"clean": {"pattern.0": None}}
    with pytest.raises(PlanError, match="site pattern can be captured, not patched"):
        engine.run([Request(tokens=(3, 4, 5), patches=(Patch("pattern", 0, "clean", (0,), 0),))], src)
    # tiny-llama: 4 query heads, 2 key/value heads
    with pytest.raises(PlanError, match="patch head 2 is out of range \\(model has 2 key/value heads per layer\\)"):
        engine.run([Request(tokens=(3, 4, 5), patches=(Patch("k", 0, "clean", (0,), 2),))], src)
    with pytest.raises(PlanError, match="patch head None is out of range"):
        engine.run([Request(tokens=(3, 4, 5), patches=(Patch("q", 0, "clean", (0,)),))], src)
