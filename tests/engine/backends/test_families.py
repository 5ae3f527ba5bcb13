"""Each model family's own features, shown active (one tiny model per family; the suite's other tests
run on tiny-llama, tiny-qwen3 and tiny-gpt2): a mixture of experts routes to several experts and has
no neuron site; the post-norms' and the parallel blocks' outputs are what the stream receives; the
transformers-backend families score answers whole under chunked prefill and leave transformers' own
models of the family working; Gemma's sliding windows and soft-caps are active. Every site of every
family against hf, full and started mid-stack, plain and under chunked prefill with the multiprocess
executor: test_engines_match_hf.py, whose engines these tests take again (a family whose engine runs in
processes of its own, chunked and multiprocess: tests/support/engines.py's vllm_options)."""
from __future__ import annotations

import pytest
import torch

from patchgrid.backends.engine import load_engine
from patchgrid.model.sites import shape_of
from patchgrid.plan import LOGPROBS, Noise, Patch, PlanError, Request
from tests.support.backends import assert_results_close, effect_spread
from tests.support.engines import hook_count, needs_vllm, vllm_options

from .test_engines_match_hf import ANSWERS, CLEAN, CORRUPT, TRANSFORMERS_BACKEND

pytestmark = needs_vllm


# The chunked multiprocess engines test_engines_match_hf.py started last (multiprocess is inherent to these
# families), which the tests after these two take too; then the plain engines of its rows, which start again
# in a second if the pool closed them (an engine of its own process, as these are, takes far longer).
@pytest.mark.parametrize("model", TRANSFORMERS_BACKEND)
def test_a_transformers_backend_family_scores_answers_whole_under_chunked_prefill(engines, model):
    """Answers of several tokens, split across steps, with a KL divergence: the rows before a
    request's last are unembedded from the final norm's output (where the batch dim is)."""
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32", **vllm_options(model))
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
    vl = engines.get(model, "vllm", dtype="float32", **vllm_options(model))
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


@pytest.mark.parametrize("model", TRANSFORMERS_BACKEND + ("tiny-gemma2", "tiny-gptj"))
def test_attn_out_and_mlp_out_are_what_the_stream_receives(engines, model):
    """Gemma, OLMo 2: the post-norms' outputs (resid_mid = resid_pre + attn_out, resid = resid_mid + mlp_out).
    GPT-J, GPT-NeoX, parallel blocks: resid = resid_pre + attn_out + mlp_out, and resid_mid does not exist."""
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32", **vllm_options(model))
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


def test_a_mixture_of_experts_routes_to_several_experts_and_has_no_neuron_site(engines):
    hf = engines.get("tiny-qwen3-moe", "hf", dtype="float32")
    vl = engines.get("tiny-qwen3-moe", "vllm", dtype="float32", **vllm_options("tiny-qwen3-moe"))
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

