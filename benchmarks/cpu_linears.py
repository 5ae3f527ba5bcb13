"""How vLLM's CPU matrix kernels use the cores at the row counts of a study's steps: a model's
linear layers (smollm2-135m's by default; qkv, o_proj, gate_up, down, their shapes read from its
config; one weight of each shape per layer, as its layers hold)
multiplied through vLLM's oneDNN handler (`ops.create_onednn_mm`, as vLLM makes it for a dense
weight on a CPU) on every core and on one, and, where the CPU has AMX, through vLLM's other CPU
kernel (`weight_packed_linear`, sgl-kernel's, which vLLM uses for weights of at most 1 MiB).

A started step of the benchmarks' grids holds about 700 to 1,100 rows (each engine call holds the
runs of one start layer), an every-layer step about 5,000 to 7,000. Where a kernel takes as long
on one core as on all of them, it ran on one: on a 2-core machine with AMX, in bf16, oneDNN runs
qkv and down at a started step's size on one core (docs/benchmarks.md). Random weights and inputs;
each figure the quickest of `--repeats` passes over the layers' weights, in microseconds a call.

    .venv/bin/python benchmarks/cpu_linears.py [--model smollm2-135m] [--dtype bfloat16|float16|float32]
        [--rows 726,1065,5262] [--repeats 3]

In the model's own dtype (bf16 for smollm2-135m), or in float32 on a CPU without bf16 units
(patchgrid.runtime.machine.machine_dtype), where bf16 would be emulated. It finishes in under a minute on a
2-core machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def linear_shapes(shape) -> dict[str, tuple[int, int]]:
    """A llama-family model's linear layers as vLLM fuses them, from its ModelShape: name -> (out, in)."""
    d, ff = shape.d_model, shape.d_mlp
    q, kv = shape.n_heads * shape.head_dim, (shape.n_kv_heads or shape.n_heads) * shape.head_dim
    return {"qkv": (q + 2 * kv, d), "o_proj": (d, q), "gate_up": (2 * ff, d), "down": (d, ff)}


def quickest(fn, kernels, x, repeats: int) -> float:
    """The quickest pass of `fn(kernel, x)` over every kernel, in seconds a call."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass makes oneDNN's primitives for this row count
        t0 = time.perf_counter()
        for k in kernels:
            fn(k, x)
        best = min(best, (time.perf_counter() - t0) / len(kernels))
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a llama-family model: its layers' shapes")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                        help="default: the model's own, or float32 on a CPU without bf16 units")
    parser.add_argument("--rows", default="726,1065,5262", help="row counts (a step's tokens), comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    import vllm._custom_ops as ops
    from transformers import AutoConfig

    from patchgrid.backends.engine import model_dtype
    from patchgrid.model.models import prepare
    from patchgrid.model.sites import shape_of
    from patchgrid.runtime.machine import machine, machine_dtype

    print(machine())
    config = AutoConfig.from_pretrained(prepare(args.model))
    name, why = machine_dtype(args.dtype)
    name = model_dtype(config) if name == "auto" else name
    dtype = getattr(torch, name)
    model_shape = shape_of(config)
    shapes, layers = linear_shapes(model_shape), model_shape.n_layers
    rows = [int(r) for r in args.rows.split(",")]
    sgl = dtype != torch.float32 and torch.cpu._is_amx_tile_supported()
    threads = torch.get_num_threads()
    print(f"will time {args.model}'s linear shapes {shapes} in {name} ({why}), {layers} weights each, at {rows} rows, "
          f"on {threads} threads and on 1, through vLLM's oneDNN handler"
          + (" and its weight_packed_linear (AMX)" if sgl else " (weight_packed_linear needs AMX: not timed)"))
    if not ops._supports_onednn:
        raise SystemExit("this vLLM build has no oneDNN handler (create_onednn_mm_handler)")
    torch.manual_seed(0)
    weights = {s: [torch.randn(n, k).to(dtype) for _ in range(layers)] for s, (n, k) in shapes.items()}
    onednn = {s: [ops.create_onednn_mm(w.t(), 32) for w in ws] for s, ws in weights.items()}
    packed = {s: [torch.ops._C.convert_weight_packed(w) for w in ws] for s, ws in weights.items()} if sgl else {}

    def by_onednn(handler, x):
        return ops.onednn_mm(handler, x, None)

    def by_sgl(shape):
        return lambda weight, x: ops.weight_packed_linear_cpu(x, weight, shapes[shape][0], None)

    head = f"{'rows':>6}  {'shape':<8} {'oneDNN, ' + str(threads) + ' threads':>18} {'oneDNN, 1 thread':>17}"
    print(head + (f" {'weight_packed, ' + str(threads):>18}" if sgl else "") + "   (us a call)")
    for m in rows:
        for shape, (_, k) in shapes.items():
            x = torch.randn(m, k).to(dtype)
            many = quickest(by_onednn, onednn[shape], x, args.repeats)
            torch.set_num_threads(1)
            one = quickest(by_onednn, onednn[shape], x, args.repeats)
            torch.set_num_threads(threads)
            line = f"{m:>6}  {shape:<8} {1e6 * many:>18.0f} {1e6 * one:>17.0f}"
            if sgl:
                line += f" {1e6 * quickest(by_sgl(shape), packed[shape], x, args.repeats):>18.0f}"
            print(line + f"   oneDNN used {one / many:.1f}x one core's speed")


if __name__ == "__main__":
    main()
