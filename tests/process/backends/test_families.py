"""Chunked prefill and vLLM's multiprocess executor at once, family by family: on an engine that splits
every 40-token prompt across steps of at most 32 tokens and runs the model in worker processes of its
own, every site kind's captures (stitched from several steps, across processes), attention patterns
(the keys of earlier steps kept by the worker) and patches at the first and the last layer match the
hf reference. Each family's sites on its plain engine, and its own features shown active:
tests/engine/backends/test_families.py."""
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
# transformers-backend families, whose chunked multiprocess engines tests/engine/backends/test_families.py
# starts too (first here, for the pool to find them alive in one session); every family runs that file's first test.
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

