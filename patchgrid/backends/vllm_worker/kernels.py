"""vLLM's own C kernels for the RMS norms of an eager forward on a CPU.

patchgrid runs vLLM eagerly (forward hooks never fire inside a compiled graph). On a CPU, vLLM's
RMS norms (`vllm.ir.ops.rms_norm`, `fused_add_rms_norm`) then dispatch to their native PyTorch
form: vLLM marks its C kernels for them (`vllm.kernels.vllm_c`) as GPU-only and relies on
torch.compile to fuse the native form on a CPU. Unfused, that form is a chain of whole-tensor
operations (cast to float32, add, square, mean, rsqrt, scale, cast back, multiply, cast back),
which took about 30% of an eager bf16 forward of smollm2-135m on two cores; a single kernel does the
same work about twenty times as fast in bf16, four to five times in float32. The CPU build of vLLM ships them
(`torch.ops._C.rms_norm`, `torch.ops._C.fused_add_rms_norm`), and `use_cpu_kernels` puts them first
in the two ops' dispatch order in the worker's process, under the provider name `PROVIDER`.

What changes in the numbers, within the model's dtype's rounding: the plain norm is computed in
float32 and rounded once, where the native form rounds the normalised value to the dtype and again
after the weight; the fused norm takes the variance of the float32 sum, as the native form does, but
normalises the residual as the dtype holds it, then the weight, then rounds once. In bf16 the outputs
differ from the native form's by one unit in the last place on about a third of elements; in float32
by float32 rounding. The residual is the same to the bit. A row's norm is its own: it does not depend
on the other rows of the batch. Started and every-layer runs, Ray and local, all use the same
kernels (tests/engine/backends/test_cpu_kernels.py holds them to the float64 definition).

The kernels write in place; these implementations work on copies and return new tensors, as the
native form does, so that no tensor a hook has read or written is changed behind it. A case the
kernel does not take (a variance over part of the width, no weight or a weight of another dtype, a
non-contiguous input, a dtype other than float32, bf16 or float16) falls back to the native form.
"""
import torch
from torch import Tensor  # the implementations' signatures must be the native ones' to the letter

PROVIDER = "patchgrid_cpu"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _takes(x: torch.Tensor, weight: torch.Tensor | None, variance_size: int | None,
           residual: torch.Tensor | None = None) -> bool:
    """Whether the C kernel computes this case: the whole width, a weight of x's dtype, contiguous
    inputs on the CPU, a floating dtype it is built for."""
    return (variance_size is None and weight is not None and weight.dtype == x.dtype and x.dtype in _DTYPES
            and x.device.type == "cpu" and x.is_contiguous()
            and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)))


def _rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def _fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                        variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    out, residual = x.clone(), x_residual.clone()  # the kernel writes both in place
    torch.ops._C.fused_add_rms_norm(out, residual, weight, epsilon)
    return out, residual


def _norm_ops() -> tuple:
    """vLLM's two RMS norm IR ops with the kernels registered on them (once per process); () where
    this vLLM build has no such kernels (or no IR ops)."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads the _C library on a CPU)
        import vllm.ir.ops  # noqa: F401
        from vllm import ir
    except ImportError:
        return ()
    if not (hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")):
        return ()
    norm, fused = ir.ops.rms_norm, ir.ops.fused_add_rms_norm
    if PROVIDER not in norm.impls:
        norm.register_impl(PROVIDER, supports_args=lambda x, weight, epsilon, variance_size=None:
                           _takes(x, weight, variance_size))(_rms_norm)
    if PROVIDER not in fused.impls:
        fused.register_impl(PROVIDER, supports_args=lambda x, x_residual, weight, epsilon, variance_size=None:
                            _takes(x, weight, variance_size, x_residual))(_fused_add_rms_norm)
    return norm, fused


def use_cpu_kernels(device: torch.device) -> list[str]:
    """On a CPU, put vLLM's C kernels first in its RMS norms' dispatch order, for this process (the
    worker's), ahead of whatever came before; elsewhere change nothing. Returns the ops now led by
    them (empty where none is)."""
    if torch.device(device).type != "cpu":
        return []
    led = []
    for op in _norm_ops():
        before = [p for p in op.get_priority() if p != PROVIDER] or ["native"]
        op.set_default([PROVIDER, *before])
        led.append(op.name)
    return led
