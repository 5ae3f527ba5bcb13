"""Model families beyond the three the whole suite runs on: every site kind the family has, from
vLLM against the hf reference, with prompts longer than a sliding window and runs started
mid-stack; then once more on an engine that both splits prompts by chunked prefill and runs
vLLM's multiprocess executor; and each tiny model's own features shown to be active (one model per
family; the suite's per-site tests run on tiny-llama, tiny-qwen3, tiny-gpt2)."""
from __future__ import annotations

import pytest

from patchgrid.plan import Request
from tests.engine.backends.test_families import ANSWERS, CHUNKED_MULTIPROCESS, CLEAN, CORRUPT, TRANSFORMERS_BACKEND
from tests.support.backends import (
    all_keys,
    assert_patterns_close,
    assert_results_close,
    effect_spread,
    every_site_requests,
)
from tests.support.engines import needs_vllm

pytestmark = needs_vllm


# Chunked prefill and the multiprocess executor are the engine's, not a family's: run once per kind of
# attention and layer that could meet them differently (sliding and global layers, experts) and on the
# transformers-backend families, whose engines the tests above started; every family runs the first test.
# (The transformers-backend families first: their engines are alive from the tests above.)
CHUNKED_FAMILIES = TRANSFORMERS_BACKEND + ["tiny-gemma2", "tiny-qwen3-moe"]


@pytest.mark.parametrize("model", CHUNKED_FAMILIES)
def test_every_site_matches_hf_under_chunked_prefill_and_the_multiprocess_executor(engines, model):
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32", **CHUNKED_MULTIPROCESS)
    cap = Request(tokens=CLEAN, answers=ANSWERS, capture=tuple(all_keys(hf.shape)))
    clean = hf.run([cap])
    read = vl.run([cap])
    assert_results_close(clean, read)  # captures stitched from several steps, across processes
    assert_patterns_close(clean, read, hf.shape.n_heads)  # the keys of earlier steps kept by the worker
    # every site kind, at a sliding and a global layer (Gemma 2), the first and the last
    reqs = every_site_requests(hf.shape, CORRUPT, ANSWERS, layers=(0, hf.shape.n_layers - 1))
    sources = {"clean": clean[0].captures}
    got = vl.run(reqs, sources)
    assert_results_close(hf.run(reqs, sources), got)
    assert effect_spread(got) > 0.05

