"""Engines refuse bad plans before running anything, and stay usable afterwards."""
from __future__ import annotations

import pytest
import torch

from patchgrid.plan import Patch, PlanError, Request
from tests.support.engines import hook_count, needs_vllm


@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=needs_vllm), "hf"])
def test_engine_refuses_then_still_works(engines, backend):
    engine = engines.get("tiny-llama", backend, dtype="float32")
    good = Request(tokens=(3, 4, 5), answers=(6,))
    baseline = engine.run([good])[0].answer_logits
    bad = Request(tokens=(3, 4, 5), answers=(6,), patches=(Patch("resid", 99, "clean", (0,)),))
    with pytest.raises(PlanError, match="request 1: patch layer 99 is out of range"):
        engine.run([good, bad], {"clean": {"resid.99": None}})
    assert hook_count(engine) == 0
    assert (engine.run([good])[0].answer_logits == baseline).all()


@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=needs_vllm), "hf"])
def test_a_pattern_over_several_forwards_is_refused_with_the_reason(engines, backend):
    engine = engines.get("tiny-llama", backend, dtype="float32")
    with pytest.raises(PlanError, match="request 0: capture pattern.1: a pattern is read over one forward"):
        engine.run([Request(tokens=(3, 4, 5), answers=(6,), continuations=((6, 7),), capture=("pattern.1",))])
    assert hook_count(engine) == 0


@pytest.mark.parametrize("backend", [pytest.param("vllm", marks=needs_vllm), "hf"])
def test_a_pattern_of_another_length_and_bad_units_of_q_k_v_are_refused_as_patches(engines, backend):
    engine = engines.get("tiny-llama", backend, dtype="float32")
    src = {"clean": {"pattern.0": torch.zeros(4, 16)}}  # a 4-token prompt's pattern (4 heads x 4 keys)
    with pytest.raises(PlanError, match="pattern.0 has shape \\(4, 16\\), expected \\[3, 12\\]"):
        engine.run([Request(tokens=(3, 4, 5), patches=(Patch("pattern", 0, "clean", (0,), 0),))], src)
    # tiny-llama: 4 query heads, 2 key/value heads
    with pytest.raises(PlanError, match="patch head 2 is out of range \\(model has 2 key/value heads per layer\\)"):
        engine.run([Request(tokens=(3, 4, 5), patches=(Patch("k", 0, "clean", (0,), 2),))], src)
    with pytest.raises(PlanError, match="patch head None is out of range"):
        engine.run([Request(tokens=(3, 4, 5), patches=(Patch("q", 0, "clean", (0,)),))], src)
