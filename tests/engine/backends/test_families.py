"""Model families beyond the three the whole suite runs on: every site kind the family has, from
vLLM against the hf reference, with prompts longer than a sliding window and runs started
mid-stack; each tiny model's own features shown to be active (one model per family; the suite's
per-site tests run on tiny-llama, tiny-qwen3, tiny-gpt2); the transformers-backend families'
answers scored whole under chunked prefill, and transformers' own models of the family left working.
Every site kind once more on engines that both split prompts by chunked prefill and run vLLM's
multiprocess executor: tests/process/backends/test_families.py."""
from __future__ import annotations

import pytest
import torch

from patchgrid.backends.engine import load_engine
from patchgrid.cache import stream_keys
from patchgrid.model.sites import shape_of
from patchgrid.plan import LOGPROBS, Noise, Patch, PlanError, Request
from tests.support.backends import (
    all_keys,
    assert_patterns_close,
    assert_results_close,
    effect_spread,
    every_site_requests,
    starting,
)
from tests.support.engines import hook_count, needs_vllm

pytestmark = needs_vllm


CLEAN = tuple(range(21, 61))


CORRUPT = CLEAN[:10] + (250, 61) + CLEAN[12:]


ANSWERS = (5, 77)


# Families vLLM runs through its Transformers backend (sites.Family.vllm_transformers): transformers'
# own modules, in an engine process of their own, started mid-stack by stand-ins for the layers below.
TRANSFORMERS_BACKEND = ["tiny-neox", "tiny-olmo2"]


# In this order, the tests below start each vLLM engine once (the session's pool keeps three alive,
# closing the one used least recently): the plain engines of the three families the next tests use
# again (the mixture of experts, Gemma 2, GPT-J) are the last three started here.
FAMILY_MODELS = ["tiny-phi3", "tiny-gemma3"] + TRANSFORMERS_BACKEND + ["tiny-qwen3-moe", "tiny-gemma2", "tiny-gptj"]


# A step holds at most 32 tokens: every 40-token prompt is split across steps, and steps mix requests.
CHUNKED_MULTIPROCESS = dict(multiprocess=True, max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=True,
                            max_model_len=512)


@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_every_site_of_the_family_matches_hf(engines, model):
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32")
    if model in TRANSFORMERS_BACKEND:
        assert not vl._inprocess  # multiprocess without being asked (sites.Family.vllm_transformers)
    keys = tuple(all_keys(hf.shape))
    cap = Request(tokens=CLEAN, answers=ANSWERS, capture=keys)
    clean = hf.run([cap])
    read = vl.run([cap])
    assert_results_close(clean, read)
    assert_patterns_close(clean, read, hf.shape.n_heads)  # windows, soft-caps, grouped heads: the kernel's own
    reqs = every_site_requests(hf.shape, CORRUPT, ANSWERS)
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


# The plain engines the first test left, then the chunked multiprocess engines the tests after it reuse.
@pytest.mark.parametrize(("model", "options"), [("tiny-gemma2", {}), ("tiny-gptj", {}),
                                               ("tiny-neox", CHUNKED_MULTIPROCESS),
                                               ("tiny-olmo2", CHUNKED_MULTIPROCESS)])
def test_attn_out_and_mlp_out_are_what_the_stream_receives(engines, model, options):
    """Gemma, OLMo 2: the post-norms' outputs (resid_mid = resid_pre + attn_out, resid = resid_mid + mlp_out).
    GPT-J, GPT-NeoX, parallel blocks: resid = resid_pre + attn_out + mlp_out, and resid_mid does not exist.
    (Each on the engine an earlier test left, or one a later test reuses.)"""
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32", **options)
    parallel = hf.shape.family.missing("resid_mid") is not None
    sites = ("resid_pre", "attn_out", "mlp_out", "resid") + (() if parallel else ("resid_mid",))
    c = vl.run([Request(tokens=CLEAN, capture=tuple(f"{s}.{layer}" for s in sites for layer in (1, 3)))])[0].captures
    for layer in (1, 3):
        pre, attn, mlp, out = (c[f"{s}.{layer}"] for s in ("resid_pre", "attn_out", "mlp_out", "resid"))
        if parallel:
            assert torch.allclose(out, pre + attn + mlp, atol=1e-4)
        else:
            assert torch.allclose(c[f"resid_mid.{layer}"], pre + attn, atol=1e-4)
            assert torch.allclose(out, c[f"resid_mid.{layer}"] + mlp, atol=1e-4)
    if parallel:
        for engine in (hf, vl):
            with pytest.raises(PlanError, match=f"site resid_mid: the {hf.shape.family.name} block is parallel"):
                engine.run([Request(tokens=CLEAN, capture=("resid_mid.1",))])


# The tests below run on the chunked multiprocess engines the test above started (multiprocess is inherent
# to these families); the test after them reuses them.
@pytest.mark.parametrize("model", TRANSFORMERS_BACKEND)
def test_a_transformers_backend_family_scores_answers_whole_under_chunked_prefill(engines, model):
    """Answers of several tokens, split across steps, with a KL divergence: the rows before a
    request's last are unembedded from the final norm's output (where the batch dim is)."""
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32", **CHUNKED_MULTIPROCESS)
    clean = hf.run([Request(tokens=CLEAN, answers=ANSWERS, capture=("resid.2", "head.1"), logprobs=True)])[0]
    sources = {"clean": {**clean.captures, LOGPROBS: clean.logprobs}}
    continuations = (tuple(range(40, 77)), (77, 4))
    reqs = [Request(tokens=CORRUPT, answers=ANSWERS, continuations=continuations, reference="clean", patches=p)
            for p in ((), (Patch("resid", 2, "clean", (3, 39)),), (Patch("head", 1, "clean", None, 2),))]
    reqs.append(Request(tokens=CORRUPT, answers=ANSWERS, continuations=continuations, noise=(Noise((1, 2), 0.7, 5),)))
    got = vl.run(reqs, sources)
    assert_results_close(hf.run(reqs, sources), got)
    assert effect_spread(got) > 0.05


@pytest.mark.parametrize("model", TRANSFORMERS_BACKEND)
def test_a_transformers_backend_family_leaves_transformers_models_of_the_family_working(engines, model):
    """vLLM decorates transformers' decoder class in place where it loads such a model: its engine
    runs in a process of its own (see the first test), and transformers models built before and after
    it run here."""
    before = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32", **CHUNKED_MULTIPROCESS)
    assert vl.start_midstack  # started mid-stack by stand-ins for the layers below (vllm_worker.midstack.start_by)
    after = load_engine(model, "hf", dtype="float32")
    try:
        cap = Request(tokens=CLEAN, answers=ANSWERS, capture=("resid.1", "q.2", "k.2", "v.2"))
        a = before.run([cap])
        assert_results_close(a, after.run([cap]), tol=0.0)
        assert_results_close(a, vl.run([cap]))
        assert hook_count(vl) == 0  # the attention kernel's forward is its own again
    finally:
        after.close()


def test_a_sequential_gpt_neox_is_refused_by_name():
    """sites.GPT_NEOX maps the parallel block (every Pythia); a sequential one has a resid_mid it would miss."""
    from transformers import GPTNeoXConfig

    with pytest.raises(ValueError, match="'gpt_neox' with use_parallel_residual=False is not supported"):
        shape_of(GPTNeoXConfig(use_parallel_residual=False))


def _logits(folder, tokens, **config):
    """transformers' own eager forward (no patchgrid), with config fields overridden."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    for k, v in config.items():
        setattr(cfg, k, v)
    model = AutoModelForCausalLM.from_pretrained(folder, config=cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("model", ["tiny-gemma2", "tiny-gemma3"])
def test_gemma_sliding_windows_and_soft_caps_are_active_and_the_hf_backend_keeps_them(engines, model):
    hf = engines.get(model, "hf", dtype="float32")
    want = _logits(hf.folder, CLEAN)
    got = hf.run([Request(tokens=CLEAN, answers=tuple(range(hf.shape.vocab_size)))])[0].answer_logits
    # the hf backend runs the model as transformers' eager attention does (sdpa would drop the cap)
    assert (got - want).abs().max() < 1e-4
    # prompts longer than the window: a global window changes the answer
    assert (_logits(hf.folder, CLEAN, sliding_window=4096) - want).abs().max() > 0.05
    if model == "tiny-gemma2":
        assert (_logits(hf.folder, CLEAN, attn_logit_softcapping=None) - want).abs().max() > 0.05
        assert want.abs().max() <= 3.0 < _logits(hf.folder, CLEAN, final_logit_softcapping=None).abs().max()

