"""Patched runs that start mid-stack (plan.Start) from the run their direction names: noising from
the clean stream, tracing from the noised run, each equal to the full forward and hf; a failed call
puts the start layer back; an engine asked for full forwards ignores starts. Every site at every
layer started, against the full forward and hf, family by family: test_engines_match_hf; chunked
prefill, many steps and the multiprocess executor with starts: test_vllm_scheduling; tensor
parallelism: test_vllm_tensor_parallel."""
from __future__ import annotations

import pytest

from patchgrid.cache import stream_keys
from patchgrid.plan import Patch, Request
from tests.support.backends import all_keys, assert_results_close, reading_logprobs, starting
from tests.support.engines import TINY, hook_count, needs_vllm, start_layers

pytestmark = needs_vllm

CLEAN = (21, 7, 143, 88, 301, 12, 9, 40)
CORRUPT = (21, 7, 250, 61, 301, 12, 9, 40)
ANSWERS = (5, 77)


def every_layer_requests(shape, tokens, source="clean"):
    """Every site at every layer (0 and the last included), at one early position, the last, and all;
    each returning its log-probabilities (reading_logprobs)."""
    n = len(tokens)
    reqs = [Request(tokens=tokens, answers=ANSWERS, top_k=5)]  # unpatched: only the last layer runs
    for layer in range(shape.n_layers):
        for positions in ((1,), (n - 1,), None):
            for site in ("resid", "attn_out", "mlp_out"):
                reqs.append(Request(tokens=tokens, answers=ANSWERS, patches=(Patch(site, layer, source, positions),)))
            reqs.append(Request(tokens=tokens, answers=ANSWERS,
                                patches=(Patch("head", layer, source, positions, layer % shape.n_heads),)))
    # two patches: the lower one decides the start; a capture on the start stream
    reqs.append(Request(tokens=tokens, answers=ANSWERS, capture=("resid.1", "resid.2"),
                        patches=(Patch("resid", 1, source, (2,)), Patch("mlp_out", 2, source, (3,)))))
    return reading_logprobs(reqs)


# tiny-neox: a decoder that loops over every layer (vLLM's Transformers backend), started by stand-ins
ENGINE_MODELS = TINY + ("tiny-neox",)  # pair_of_engines (tests/engine/backends/conftest.py) runs each


def _sources(engine):
    clean = engine.run([Request(tokens=CLEAN, answers=ANSWERS, capture=tuple(all_keys(engine.shape)))])[0]
    corrupt = engine.run([Request(tokens=CORRUPT, answers=ANSWERS, capture=stream_keys(engine.shape.n_layers))])[0]
    return {"clean": clean.captures, "corrupt": corrupt.captures}


def test_noising_and_tracing_starts_from_their_own_runs(pair_of_engines):
    """Noise direction: corrupt into clean, from the clean stream; tracing: from the noised run."""
    from patchgrid.plan import Noise

    hf, vl = pair_of_engines
    n_layers = vl.shape.n_layers
    noise = (Noise((2, 3), 0.8, 5),)
    keys = tuple(all_keys(vl.shape))
    clean, corrupt, noised = vl.run([Request(tokens=CLEAN, answers=ANSWERS, capture=keys),
                                     Request(tokens=CORRUPT, answers=ANSWERS, capture=keys),
                                     Request(tokens=CLEAN, answers=ANSWERS, noise=noise, capture=keys)])
    sources = {"clean": clean.captures, "corrupt": corrupt.captures, "noised": noised.captures}
    noising = [Request(tokens=CLEAN, answers=ANSWERS, patches=(Patch("resid", layer, "corrupt", (3,)),))
               for layer in range(n_layers)]
    tracing = [Request(tokens=CLEAN, answers=ANSWERS, noise=noise,
                       patches=tuple(Patch("mlp_out", w, "clean", (3,)) for w in range(layer, n_layers)))
               for layer in range(n_layers)] + [Request(tokens=CLEAN, answers=ANSWERS, noise=noise)]
    reqs = noising + tracing
    started = starting(noising, n_layers, "clean") + starting(tracing, n_layers, "noised")
    full, skipped, ref = vl.run(reqs, sources), vl.run(started, sources), hf.run(started, sources)
    assert_results_close(skipped, full)
    assert_results_close(skipped, ref)
    # the noised run differs from the clean one: a start from the clean stream would be caught
    assert (full[-1].answer_logits - clean.answer_logits).abs().max() > 1e-3


def test_the_start_layer_goes_back_when_a_call_fails(engines):
    # its own engine: a step that raised leaves this engine unusable, which is what it should say
    vl = engines.get("tiny-llama", "vllm", dtype="float32", max_num_seqs=7)
    with pytest.raises(RuntimeError, match="does not start at layer 2"):
        vl._generate([Request(tokens=CORRUPT, answers=ANSWERS)], {}, 2)  # a request without its stream
    assert start_layers(vl) == [0] and hook_count(vl) == 0
    with pytest.raises(RuntimeError, match="failed in an earlier call .* start a new one"):
        vl.run([Request(tokens=CORRUPT, answers=ANSWERS)])


def test_full_forward_engine_option_ignores_starts(engines):
    vl = engines.get("tiny-gpt2", "vllm", dtype="float32", start_midstack=False)
    sources = _sources(vl)
    reqs = every_layer_requests(vl.shape, CORRUPT)[:20]
    assert not vl.start_midstack
    assert_results_close(vl.run(starting(reqs, vl.shape.n_layers), sources), vl.run(reqs, sources), tol=0.0)
