"""vLLM's C kernels for the RMS norms of an eager forward on a CPU (backends/vllm_worker/kernels.py).

The reference is the definition, written here in float64: s = x (+ residual, summed exactly), the
output s times the reciprocal root of the mean of s squared (plus epsilon) times the weight, the
residual s rounded to the dtype. vLLM's native form rounds the normalised value to the dtype and
again after the weight; the fused kernel normalises the residual as the dtype holds it (one rounding)
and rounds once after the weight; the plain kernel rounds once. Each is held to the bound its
roundings allow: two units of the dtype's rounding for the fused norm, one for the plain kernel.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.engines import TINY, needs_vllm

pytestmark = needs_vllm
EPS = 1e-6
# the largest relative error of one rounding to the dtype (its unit roundoff), a little over for float32
# arithmetic; for float32 itself, float32's arithmetic over the width
ROUNDING = {torch.float32: 5e-7, torch.bfloat16: 2.0**-8 * 1.001, torch.float16: 2.0**-11 * 1.001}


@pytest.fixture
def ops():
    """vLLM's two norm ops with the kernels first, their dispatch order put back afterwards."""
    from vllm import ir

    from patchgrid.backends.vllm_worker.kernels import use_cpu_kernels

    norm, fused = ir.ops.rms_norm, ir.ops.fused_add_rms_norm
    before = {op: op.get_priority() for op in (norm, fused)}
    assert use_cpu_kernels(torch.device("cpu")) == ["rms_norm", "fused_add_rms_norm"]
    yield norm, fused
    for op, priority in before.items():
        if priority:
            op.set_default(priority)
        else:
            op._priority_impls = []  # never set in this process: back to vLLM's fallback


def _definition(x, residual, weight):
    s = x.double() if residual is None else x.double() + residual.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


def _within(got, want, roundings):
    return ((got.double() - want).abs() <= roundings * want.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernels_compute_the_rms_norm_within_their_roundings_and_leave_their_inputs(ops, dtype):
    from patchgrid.backends.vllm_worker.kernels import PROVIDER

    norm, fused = ops
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 96, generator=g) * 3).to(dtype)
    residual = (torch.randn(37, 96, generator=g) * 5).to(dtype)
    weight = (torch.rand(96, generator=g) + 0.5).to(dtype)
    x0, r0 = x.clone(), residual.clone()
    assert fused.dispatch(x, residual, weight, EPS).provider == PROVIDER
    assert norm.dispatch(x, weight, EPS).provider == PROVIDER

    out, new_residual = fused.maybe_inplace(x, residual, weight, EPS)
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # new tensors, as the native form returns
    assert torch.equal(new_residual, (x.double() + residual.double()).to(dtype))
    assert _within(out, _definition(x, residual, weight), 2 * ROUNDING[dtype])
    assert _within(norm(x, weight, EPS), _definition(x, None, weight), ROUNDING[dtype])
    if dtype != torch.float32:  # the native form's two roundings exceed one: the bound can tell them apart
        native = norm.impls["native"].impl_fn(x, weight, EPS)
        assert not _within(native, _definition(x, None, weight), ROUNDING[dtype])

    # a row's norm is its own: read alone it is the same
    row_out, _ = fused.maybe_inplace(x[5:6].clone(), residual[5:6].clone(), weight, EPS)
    assert torch.equal(row_out, out[5:6])


def test_cases_the_kernels_do_not_take_fall_back_to_the_native_form(ops):
    norm, fused = ops
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    r = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.rand(16)
    assert fused.dispatch(x, r, w, EPS).provider == "native"  # a float32 weight on bf16 inputs
    assert fused.dispatch(x, r, w.bfloat16(), EPS, 8).provider == "native"  # a variance over part of the width
    wide = torch.randn(16, 4, dtype=torch.bfloat16).T  # not contiguous
    assert norm.dispatch(wide, w.bfloat16(), EPS).provider == "native"
    assert norm.dispatch(x, None, EPS).provider == "native"


def _led_by_the_kernels(worker) -> list[str]:
    """On an engine's worker (collective_rpc's callable): the norm ops whose dispatch the kernels lead."""
    from vllm import ir

    from patchgrid.backends.vllm_worker.kernels import PROVIDER

    return [op.name for op in (ir.ops.rms_norm, ir.ops.fused_add_rms_norm) if op.get_priority()[:1] == [PROVIDER]]


def test_a_cpu_engine_runs_its_norms_on_vllms_kernels(engines):
    engine = engines.get(TINY[0], "vllm", dtype="float32")
    assert engine.llm.collective_rpc(_led_by_the_kernels) == [["rms_norm", "fused_add_rms_norm"]]
