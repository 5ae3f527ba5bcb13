"""Model families beyond the three the whole suite runs on: every site kind the engine has, from
vLLM against the hf reference, with prompts long enough to be several chunks and runs started
mid-stack (one model per family; the suite's per-site tests run on tiny-llama, tiny-qwen3, tiny-gpt2)."""
from __future__ import annotations

import pytest
import torch

from patchgrid.cache import stream_keys
from patchgrid.plan import PlanError, Request
from tests.conftest import needs_vllm

from .helpers import all_keys, assert_results_close, effect_spread, every_site_requests, starting

pytestmark = needs_vllm
CLEAN = tuple(range(21, 61))
CORRUPT = CLEAN[:10] + (250, 61) + CLEAN[12:]
ANSWERS = (5, 77)


def _without_neurons(shape, items, key):
    """A mixture-of-experts MLP has no neuron site (sites.Family.experts)."""
    return [x for x in items if not (shape.family.experts and key(x))]


@pytest.mark.parametrize("model", ["tiny-phi3", "tiny-qwen3-moe"])
def test_every_site_of_the_family_matches_hf(engines, model):
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32")
    keys = tuple(_without_neurons(hf.shape, all_keys(hf.shape), lambda k: k.startswith("neuron")))
    cap = Request(tokens=CLEAN, answers=ANSWERS, capture=keys)
    clean = hf.run([cap])
    assert_results_close(clean, vl.run([cap]))
    reqs = _without_neurons(hf.shape, every_site_requests(hf.shape, CORRUPT, ANSWERS),
                            lambda r: any(p.site == "neuron" for p in r.patches))
    sources = {"clean": clean[0].captures}
    got = vl.run(reqs, sources)
    assert_results_close(hf.run(reqs, sources), got)
    assert effect_spread(got) > 0.05
    stream = hf.run([Request(tokens=CORRUPT, answers=ANSWERS, capture=stream_keys(hf.shape.n_layers))])[0]
    started = starting([r for r in reqs if not r.noise], hf.shape.n_layers)
    assert any(r.start for r in started)
    sources["corrupt"] = stream.captures
    assert_results_close(hf.run(started, sources), vl.run(started, sources))


def test_a_mixture_of_experts_routes_to_several_experts_and_has_no_neuron_site(engines):
    hf = engines.get("tiny-qwen3-moe", "hf", dtype="float32")
    vl = engines.get("tiny-qwen3-moe", "vllm", dtype="float32")
    layer = hf.model.model.layers[1].mlp
    seen = []
    handle = layer.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))  # (logits, weights, experts)
    try:
        hf.run([Request(tokens=CLEAN, answers=ANSWERS)])
    finally:
        handle.remove()
    assert len(torch.unique(seen[0])) > 1, "the tiny MoE routes every token to the same experts"
    for engine in (hf, vl):
        with pytest.raises(PlanError, match="site neuron: the qwen3_moe MLP is a mixture of experts"):
            engine.run([Request(tokens=CORRUPT, capture=("neuron.0",))])
