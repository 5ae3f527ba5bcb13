"""Circuit runs (plan.Circuit, backends.edge_ablation): vLLM against the hf backend, the two ends
of the curve (every edge kept is the clean run, none kept the source run), and one ablated edge
against the edge intervention written in tests/engine/methods/test_edge_attribution.py from the weights."""
from __future__ import annotations

import pytest
import torch

from patchgrid.backends.edge_ablation import check_circuits
from patchgrid.methods.graph import EdgeGraph, circuit_keys
from patchgrid.model.sites import FAMILIES, ModelShape
from patchgrid.plan import Circuit, Patch, PlanError, Request


def _shape(family="llama", layers=2):
    return ModelShape(FAMILIES[family], layers, 4, 8, 32, 100, 64, 64, 2)


def test_circuit_requests_that_cannot_run_are_refused_naming_the_field():
    shape = _shape()
    src = {"c": {k: torch.zeros(3, shape.width(k.split(".")[0])) for k in circuit_keys(2)}}
    ok = Request((1, 2, 3), (4, 5), circuit=Circuit("c", (0, 1)))
    check_circuits([ok], src, shape)
    n = len(EdgeGraph.of(shape).edges)
    bad = [
        (Request((1, 2, 3), (4,), circuit=Circuit("c", (n,))), "kept edge index out of range"),
        (Request((1, 2, 3), (4,), circuit=Circuit("x")), "source 'x' is not among"),
        (Request((1, 2, 3, 4), (4,), circuit=Circuit("c")), r"resid_pre.0 has shape \(3, 32\)"),
        (Request((1, 2, 3), (4,), circuit=Circuit("c"), patches=(Patch("resid", 0, "c"),)), "no patches"),
        (Request((1, 2, 3), (4,), circuit=Circuit("c"), continuations=((4, 5),)),
         r"expected \[4, 32\] \(the prompt and its continuations' inputs\)"),
    ]
    for req, message in bad:
        with pytest.raises(PlanError, match=message):
            check_circuits([ok, req], src, shape)
    src_short = {"c": {k: v for k, v in src["c"].items() if k != "mlp_out.1"}}
    with pytest.raises(PlanError, match="holds no mlp_out.1"):
        check_circuits([ok], src_short, shape)
    with pytest.raises(PlanError, match="gptj block is parallel"):
        check_circuits([ok], src, _shape("gptj"))
    with pytest.raises(PlanError, match="gemma2 family normalises"):
        check_circuits([ok], src, _shape("gemma2"))

