"""One way to get an engine, whatever the backend: `load_engine(model, backend=...)`.

Every backend takes the same `Request`s (patchgrid.plan) and returns `Result`s in order.
"""
from __future__ import annotations

import torch

from .models import prepare
from .sites import shape_of

BACKENDS = ("vllm", "hf")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def model_dtype(config) -> str:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(dt).removeprefix("torch.")


def load_engine(model: str, backend: str = "vllm", *, dtype: str = "auto", **options):
    """Prepare `model` (a built-in name, folder or hub id) and start a backend on it."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    from transformers import AutoConfig

    folder = prepare(model)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    shape = shape_of(config)
    if dtype == "auto":
        # vLLM's "auto" downcasts float32 checkpoints to bfloat16 on CPU; both backends must
        # run the dtype the checkpoint says.
        dtype = model_dtype(config)
    if backend == "hf":
        from .backends.hf import HFEngine

        engine = HFEngine(folder, shape, dtype=dtype, **options)
    else:
        from .backends.vllm import VllmEngine

        engine = VllmEngine(folder, shape, dtype=dtype, **options)
    engine.folder = folder
    engine.dtype = getattr(torch, dtype)
    return engine
