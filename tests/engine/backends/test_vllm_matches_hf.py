"""The vLLM backend gives the Hugging Face reference's numbers, site by site, on every family."""
from __future__ import annotations

import torch

from patchgrid.plan import Patch, Request
from tests.support.backends import (
    all_keys,
    assert_patterns_close,
    assert_results_close,
    effect_spread,
    every_site_requests,
)
from tests.support.engines import hook_count, needs_vllm

pytestmark = needs_vllm

CLEAN = (21, 7, 143, 88, 301, 12, 9, 40)
CORRUPT = (21, 7, 250, 61, 301, 12, 9, 40)
ANSWERS = (5, 77)


def test_captures_match(pair_of_engines):
    hf, vl = pair_of_engines
    req = Request(tokens=CLEAN, answers=ANSWERS, capture=tuple(all_keys(hf.shape)))
    a, b = hf.run([req]), vl.run([req])
    assert_results_close(a, b)
    assert_patterns_close(a, b, hf.shape.n_heads)  # read on vLLM from the q and k its kernel receives
    assert b[0].captures["resid.0"].shape == (len(CLEAN), hf.shape.d_model)
    assert b[0].captures["head.0"].shape == (len(CLEAN), hf.shape.n_heads * hf.shape.head_dim)


def test_every_site_kind_patches_match(pair_of_engines):
    hf, vl = pair_of_engines
    clean = hf.run([Request(tokens=CLEAN, answers=ANSWERS, capture=tuple(all_keys(hf.shape)))])[0]
    sources = {"clean": clean.captures}
    reqs = every_site_requests(hf.shape, CORRUPT, ANSWERS)
    a, b = hf.run(reqs, sources), vl.run(reqs, sources)
    assert_results_close(a, b)
    assert effect_spread(b) > 0.05, "patches barely moved the answer; the comparison would prove little"


def test_patching_all_positions_of_resid_reproduces_clean_run(pair_of_engines):
    _, vl = pair_of_engines
    keys = tuple(f"resid.{layer}" for layer in range(vl.shape.n_layers))
    clean = vl.run([Request(tokens=CLEAN, answers=ANSWERS, capture=keys)])[0]
    last = vl.shape.n_layers - 1
    patched = vl.run([Request(tokens=CORRUPT, answers=ANSWERS, patches=(Patch("resid", last, "clean"),))],
                     {"clean": clean.captures})[0]
    assert torch.allclose(patched.answer_logits, clean.answer_logits, atol=1e-5)


def test_top_k_and_probabilities(pair_of_engines):
    hf, vl = pair_of_engines
    req = Request(tokens=CLEAN, answers=ANSWERS, top_k=3)
    a, b = hf.run([req])[0], vl.run([req])[0]
    assert b.top_ids == a.top_ids and len(b.top_ids) == 3
    assert torch.allclose(b.answer_probs, a.answer_probs, atol=1e-6)
    assert float(b.answer_probs.sum()) < 1.0


def test_hooks_removed_and_unpatched_run_is_bitwise_baseline(pair_of_engines):
    hf, vl = pair_of_engines
    plain = Request(tokens=CORRUPT, answers=ANSWERS, capture=("resid.1",))
    before = vl.run([plain])[0]
    clean = vl.run([Request(tokens=CLEAN, answers=ANSWERS, capture=tuple(all_keys(vl.shape)))])[0]
    vl.run(every_site_requests(vl.shape, CORRUPT, ANSWERS), {"clean": clean.captures})
    assert hook_count(vl) == 0 and hook_count(hf) == 0
    after = vl.run([plain])[0]
    assert torch.equal(before.answer_logits, after.answer_logits)
    assert torch.equal(before.captures["resid.1"], after.captures["resid.1"])
    # during a call vLLM's sampler is handed a zero column (readout.LogitsReadout._idle_sampler); after
    # it, vLLM's own generation samples from the model's logits again: greedy = the reference's argmax
    from vllm import SamplingParams, TokensPrompt

    out = vl.llm.generate([TokensPrompt(prompt_token_ids=list(CLEAN))], SamplingParams(max_tokens=1, temperature=0.0),
                          use_tqdm=False)
    top = hf.run([Request(tokens=CLEAN, answers=ANSWERS, top_k=1)])[0].top_ids
    assert list(out[0].outputs[0].token_ids) == list(top)


def test_a_neuron_patch_writes_one_column_of_the_down_projection_input(pair_of_engines):
    """Against a plain transformers forward whose hook writes the column itself: the neuron site is
    the down projection's input, one column per neuron."""
    from patchgrid.model.sites import get_module

    hf, vl = pair_of_engines
    layer, neuron, pos = hf.shape.n_layers - 2, 11, len(CORRUPT) - 1
    clean = hf.run([Request(tokens=CLEAN, capture=(f"neuron.{layer}",))])[0].captures[f"neuron.{layer}"]
    assert clean.shape == (len(CLEAN), hf.shape.d_mlp)
    req = Request(tokens=CORRUPT, answers=ANSWERS, patches=(Patch("neuron", layer, "clean", (pos,), neuron=neuron),))
    got = vl.run([req], {"clean": {f"neuron.{layer}": clean}})[0]
    base = vl.run([Request(tokens=CORRUPT, answers=ANSWERS)])[0]

    fam = hf.shape.family
    down = get_module(get_module(hf.model, fam.layers)[layer], fam.down_proj)

    def write(module, args):
        x = args[0].clone()
        x[0, pos, neuron] = clean[pos, neuron]
        return (x,) + args[1:]

    handle = down.register_forward_pre_hook(write)
    try:
        with torch.no_grad():
            logits = hf.model(input_ids=torch.tensor([CORRUPT])).logits[0, -1].float()
    finally:
        handle.remove()
    assert torch.allclose(got.answer_logits, logits[list(ANSWERS)], atol=1e-4)
    assert (got.answer_logits - base.answer_logits).abs().max() > 1e-4, "the neuron patch changed nothing"
