"""On a GPU, what the vLLM worker writes into activations (patch values, noise, start streams, row
indices) lives on the GPU with them: the whole engine on tiny-llama, every site patched and every
layer started mid-stack, matches the hf engine. Where there is no GPU the test is skipped: the
worker's write path is checked on any machine, with activations on PyTorch's `meta` device, by
tests/unit/backends/test_devices.py.
"""
from __future__ import annotations

import pytest
import torch

from patchgrid.plan import Request
from tests.support.engines import needs_vllm
from tests.unit.backends.test_devices import ANSWERS, CORRUPT

CLEAN = (21, 7, 143, 88, 301, 12, 9, 40)


@needs_vllm
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no GPU here: tests/unit/backends/test_devices.py checks the write path")
def test_on_a_gpu_every_site_started_or_not_matches_hf(engines):
    from tests.support.backends import all_keys, assert_results_close, every_site_requests, starting

    from .test_start_midstack import every_layer_requests

    hf = engines.get("tiny-llama", "hf", dtype="float32")
    vl = engines.get("tiny-llama", "vllm", dtype="float32")
    assert hf.device.type == "cuda"
    keys = tuple(all_keys(vl.shape))
    clean, corrupt = vl.run([Request(tokens=CLEAN, answers=ANSWERS, capture=keys),
                             Request(tokens=CORRUPT, answers=ANSWERS, capture=keys)])
    sources = {"clean": clean.captures, "corrupt": corrupt.captures}
    reqs = every_site_requests(vl.shape, CORRUPT, ANSWERS)
    reqs += starting(every_layer_requests(vl.shape, CORRUPT), vl.shape.n_layers)
    assert_results_close(hf.run(reqs, sources), vl.run(reqs, sources))
    print(f"GPU {torch.cuda.get_device_name(0)}: {len(reqs)} requests, vLLM equals hf within 1e-4")

