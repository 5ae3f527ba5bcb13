"""Patches whose result is known without a reference, and what a run reads beside its answers, on the
three families the suite runs on: the whole stream patched reproduces the clean run, top-k and
probabilities as hf reads them, and a neuron patch as a plain transformers forward writes it. Every
site against hf, family by family and started mid-stack: test_engines_match_hf.py."""
from __future__ import annotations

import torch

from patchgrid.plan import Patch, Request
from tests.support.engines import needs_vllm

pytestmark = needs_vllm

CLEAN = (21, 7, 143, 88, 301, 12, 9, 40)
CORRUPT = (21, 7, 250, 61, 301, 12, 9, 40)
ANSWERS = (5, 77)


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
