"""Pattern patching and attention knockout, each against an implementation written here from its
definition on a plain transformers model. vLLM is held to the hf backend on every family by the
requests tests.support.backends.attention_requests adds to every site's (test_engines_match_hf,
family by family, chunked prefill and the multiprocess executor among them).

- A pattern patch (TransformerLens's get_act_patch_attn_head_pattern_*) replaces one head's weights
  by the other run's and keeps this run's values: its output is the source's pattern times this
  run's values, which the head site then writes (an independent route: the head patch).
- A knockout (Geva et al. 2023) blocks attention edges before the softmax: here transformers' own
  eager attention runs with its mask raised to minus infinity at the blocked (query, key) cells in
  the layers of the window, and the patched model's answers must match the backend's.
"""
from __future__ import annotations

import pytest
import torch

from patchgrid.model.sites import get_module, site_module
from patchgrid.plan import Knockout, Patch, PlanError, Request
from tests.support.backends import assert_results_close, reading_logprobs

CLEAN = tuple(range(21, 45))


CORRUPT = CLEAN[:6] + (250,) + CLEAN[7:]


ANSWERS = (5, 77)


TOL = 1e-4


def test_knockouts_and_pattern_patches_that_cannot_run_are_refused_by_name(engines):
    hf = engines.get("tiny-llama", "hf", dtype="float32")
    n = len(CORRUPT)
    bad = [
        (Request(tokens=CORRUPT, knockout=Knockout((99,), (n - 1,), (1,))), "knockout layer 99 is out of range"),
        (Request(tokens=CORRUPT, knockout=Knockout((0,), (n,), (1,))), "knockout.queries position"),
        (Request(tokens=CORRUPT, knockout=Knockout((0,), (2,), (0, 1, 2))), "blocks every key query position 2"),
        (Request(tokens=CORRUPT, patches=(Patch("pattern", 0, "clean", None, 0),)), "expected [24, 96]"),
    ]
    sources = {"clean": {"pattern.0": torch.zeros(n, 3)}}
    for req, words in bad:
        with pytest.raises(PlanError, match=".*" + words.replace("[", r"\[").replace("]", r"\]")):
            hf.run([req], sources)


def _pattern_and_values(hf, tokens, layer):
    got = hf.run([Request(tokens=tokens, answers=ANSWERS, capture=(f"pattern.{layer}", f"v.{layer}"))])[0]
    return got.captures[f"pattern.{layer}"], got.captures[f"v.{layer}"]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_a_pattern_patch_is_the_source_pattern_applied_to_this_runs_values(engines, model):
    hf = engines.get(model, "hf", dtype="float32")
    shape, layer, head = hf.shape, 1, shape_head(hf)
    n = len(CORRUPT)
    clean_pattern, _ = _pattern_and_values(hf, CLEAN, layer)
    _, corrupt_v = _pattern_and_values(hf, CORRUPT, layer)
    w = clean_pattern.view(n, shape.n_heads, n)[:, head]  # [query, key]
    kv = head // (shape.n_heads // shape.kv_heads)
    z = w @ corrupt_v.view(n, shape.kv_heads, shape.head_dim)[:, kv]  # [query, head_dim]
    positions = (3, 6, n - 1)
    zfull = torch.zeros(n, shape.n_heads * shape.head_dim)
    zfull[:, head * shape.head_dim:(head + 1) * shape.head_dim] = z
    sources = {"clean": {f"pattern.{layer}": clean_pattern}, "z": {f"head.{layer}": zfull}}
    patched = hf.run(reading_logprobs([Request(tokens=CORRUPT, answers=ANSWERS,
                                               patches=(Patch("pattern", layer, "clean", positions, head),))]), sources)
    by_head = hf.run(reading_logprobs([Request(tokens=CORRUPT, answers=ANSWERS,
                                               patches=(Patch("head", layer, "z", positions, head),))]), sources)
    assert_results_close(patched, by_head, 1e-5)
    plain = hf.run(reading_logprobs([Request(tokens=CORRUPT, answers=ANSWERS)]))
    assert (patched[0].answer_logits - plain[0].answer_logits).abs().max() > 1e-4  # it changed something


def shape_head(engine) -> int:
    return engine.shape.n_heads - 1


def _knocked_out_by_mask(engine, tokens, layers, queries, keys):
    """The answers' logits of `tokens` on transformers' own eager attention, its additive mask set to
    minus infinity at (query, key) in `layers`: the definition, without the backend."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    fam = engine.shape.family
    handles = []

    def block(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        n = len(tokens)
        if mask is None:
            mask = torch.zeros(1, 1, n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        mask = mask.clone()
        for q in queries:
            mask[..., q, list(keys)] = float("-inf")
        kwargs["attention_mask"] = mask
        return args, kwargs

    for layer in layers:
        handles.append(site_module(model, fam, "q", layer).register_forward_pre_hook(block, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
    finally:
        for h in handles:
            h.remove()
    assert get_module(model, fam.layers)  # the layers the hooks went on
    return logits[list(ANSWERS)]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_a_knockout_equals_transformers_eager_attention_with_those_edges_masked(engines, model):
    hf = engines.get(model, "hf", dtype="float32")
    n = len(CLEAN)
    for layers, queries, keys in (((1,), (n - 1,), (2, 3, 4)), ((0, 1), (n - 1,), (n - 1,)),
                                  (tuple(range(hf.shape.n_layers)), tuple(range(5, n)), (0, 1))):
        got = hf.run([Request(tokens=CLEAN, answers=ANSWERS, knockout=Knockout(layers, queries, keys))])[0]
        want = _knocked_out_by_mask(hf, CLEAN, layers, queries, keys)
        assert (got.answer_logits - want).abs().max() <= TOL, (layers, queries, keys)
    plain = hf.run([Request(tokens=CLEAN, answers=ANSWERS)])[0]
    assert (got.answer_logits - plain.answer_logits).abs().max() > 1e-3  # the knockout changed the answer

