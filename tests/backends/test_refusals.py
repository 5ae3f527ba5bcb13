"""Engines refuse bad plans before running anything, and stay usable afterwards."""
from __future__ import annotations

import pytest

from patchgrid.plan import Patch, PlanError, Request
from tests.conftest import needs_vllm


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
