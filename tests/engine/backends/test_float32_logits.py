"""The logits a request reads are unembedded in float32 from the final hidden state, whatever the
model's dtype, on both backends.

The reference is computed here from the definition: the final norm's output (hooked on the model
that ran the forward: transformers' for the hf backend, vLLM's own for the vllm backend) cast to
float32, times the unembedding weight cast to float32, plus the head's bias, then the soft-cap of
the model's config. At logits of 8-16 a bf16 step is 1/16: logits read in bf16 are all multiples of
1/32, float32 ones almost never are.
"""
from __future__ import annotations

import pytest
import torch

from patchgrid.model.models import prepare
from patchgrid.plan import Request
from tests.support.engines import needs_vllm

SMOL = "smollm2-135m"


FRANCE = "The capital of France is"


PARIS, BERLIN = " Paris", " Berlin"


ATOL = 2e-4  # float32 products over d_model = 576 summed in another order; a bf16 step at 10 is 0.0625


def _hf_model(name: str, dtype=torch.bfloat16):
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers' sdpa leaves Gemma 2's attention cap out; GPT-J has no sdpa
    model_type = AutoConfig.from_pretrained(prepare(name)).model_type
    attn = "eager" if model_type in ("gemma2", "gptj") else "sdpa"
    return AutoModelForCausalLM.from_pretrained(prepare(name), dtype=dtype, attn_implementation=attn).eval()


@torch.no_grad()
def _reference(final_rows: torch.Tensor, model) -> torch.Tensor:
    """float32 logits [rows, vocab] of the final norm's output rows, by the definition above."""
    head = model.get_output_embeddings()
    logits = final_rows.float() @ head.weight.float().T
    if head.bias is not None:
        logits = logits + head.bias.float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def _hf_final_rows(model, norm, tokens) -> torch.Tensor:
    """The final norm's output [tokens, d_model] of a forward of `tokens`, in the model's dtype."""
    seen = []
    handle = norm.register_forward_hook(lambda m, a, out: seen.append(out[0].detach().clone()))
    try:
        with torch.no_grad():
            model(torch.tensor([list(tokens)]))
    finally:
        handle.remove()
    assert seen[0].dtype == model.dtype
    return seen[0]


def _not_bf16_steps(values) -> bool:
    return all(v * 32 != round(v * 32) for v in values)


def _check_readout(got, ref_rows: torch.Tensor, answers, continuation) -> None:
    """A request's readout against float32 reference logits [rows, vocab] from its last prompt position on."""
    last = ref_rows[0]
    assert torch.allclose(got.answer_logits, last[list(answers)], atol=ATOL, rtol=0)
    assert abs(got.logsumexp - float(torch.logsumexp(last, 0))) < ATOL
    assert got.top_ids[:3] == torch.topk(last, 3).indices.tolist()
    assert max(abs(a - b) for a, b in zip(got.top_logits, torch.topk(last, 10).values.tolist())) < ATOL
    assert torch.allclose(got.logprobs, torch.log_softmax(last, 0), atol=ATOL, rtol=0)
    want = [float(torch.log_softmax(ref_rows[k], 0)[t]) for k, t in enumerate(continuation)]
    assert max(abs(a - b) for a, b in zip(got.continuation_logprobs[0], want)) < ATOL


@pytest.fixture(scope="module")
def smol_request(tokenizers):
    tok = tokenizers(SMOL)
    prompt = tuple(tok(FRANCE)["input_ids"])
    answers = (tok(PARIS)["input_ids"][0], tok(BERLIN)["input_ids"][0])
    continuation = tuple(tok(PARIS + ", the city of light")["input_ids"])
    return Request(tokens=prompt, answers=answers, top_k=10, logprobs=True, continuations=(continuation,))


@pytest.fixture(scope="module")
def smol_hf_bf16():
    return _hf_model(SMOL)


@pytest.mark.slow
def test_hf_reads_float32_logits_of_a_bf16_model(engines, smol_request, smol_hf_bf16):
    hf = engines.get(SMOL, "hf")
    assert hf.dtype == torch.bfloat16
    got = hf.run([smol_request])[0]
    r = smol_request
    final = _hf_final_rows(smol_hf_bf16, smol_hf_bf16.model.norm, r.tokens + r.continuations[0][:-1])
    ref = _reference(final[len(r.tokens) - 1:], smol_hf_bf16)
    _check_readout(got, ref, r.answers, r.continuations[0])
    assert max(got.top_logits) > 8 and _not_bf16_steps(got.top_logits + got.answer_logits.tolist())


def _vllm_final_rows(vl, norm: str, request) -> torch.Tensor:
    """vLLM's own final-norm output [rows, d_model] over the one forward of `request` (its prompt, then
    its continuation but the last token), hooked in the in-process engine while it runs."""
    from patchgrid.model.sites import get_module

    assert vl._inprocess
    seen = []

    def hook(module, args, out):
        seen.append((out[0] if isinstance(out, tuple) else out).detach().clone())

    handles = vl.llm.apply_model(lambda m: get_module(m, norm).register_forward_hook(hook))
    try:
        got = vl.run([request])[0]
    finally:
        vl.llm.apply_model(lambda m: [h.remove() for h in handles])
    (final,) = [t for t in seen if t.shape[0] == len(request.tokens) + len(request.continuations[0]) - 1]
    return got, final


@pytest.mark.slow
@needs_vllm
def test_vllm_reads_float32_logits_of_a_bf16_model(engines, smol_request, smol_hf_bf16):
    vl = engines.get(SMOL, "vllm")
    assert vl.dtype == torch.bfloat16
    r = smol_request
    got, final = _vllm_final_rows(vl, "model.norm", r)
    assert final.dtype == torch.bfloat16
    _check_readout(got, _reference(final[len(r.tokens) - 1:], smol_hf_bf16), r.answers, r.continuations[0])
    assert max(got.top_logits) > 8 and _not_bf16_steps(got.top_logits + got.answer_logits.tolist())


@pytest.fixture(scope="module")
def biased_gptj(tmp_path_factory):
    """tiny-gptj with a seeded non-zero lm_head bias (the built model's is zero): a model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("biased-gptj")
    model = AutoModelForCausalLM.from_pretrained(prepare("tiny-gptj"), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.bias.copy_(torch.randn(model.lm_head.bias.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(prepare("tiny-gptj")).save_pretrained(folder)
    return str(folder)


TINY_REQUEST = Request(tokens=tuple(range(21, 61)), answers=(5, 77), top_k=10, logprobs=True,
                       continuations=((9, 12, 30),))


@needs_vllm
def test_vllm_float32_logits_keep_the_head_bias(engines, biased_gptj):
    """GPT-J's lm_head bias, in a bf16 vLLM engine (vLLM's GPT-J passes it to its logits processor)."""
    vl = engines.get(biased_gptj, "vllm", dtype="bfloat16")
    got, final = _vllm_final_rows(vl, "transformer.ln_f", TINY_REQUEST)
    model = _hf_model(biased_gptj)
    assert model.lm_head.bias.abs().min() > 0
    ref = _reference(final[len(TINY_REQUEST.tokens) - 1:], model)
    _check_readout(got, ref, TINY_REQUEST.answers, TINY_REQUEST.continuations[0])


@pytest.mark.parametrize("name", ["tiny-gemma2", "biased-gptj"])
def test_hf_float32_logits_keep_the_soft_cap_and_the_bias(engines, name, request):
    """Gemma 2's final soft-cap and GPT-J's lm_head bias, in a bf16 hf engine."""
    folder = request.getfixturevalue("biased_gptj") if name == "biased-gptj" else name
    model = _hf_model(folder)
    head = model.get_output_embeddings()
    assert (head.bias is not None and head.bias.abs().min() > 0) or getattr(model.config, "final_logit_softcapping", 0)
    r = TINY_REQUEST
    got = engines.get(folder, "hf", dtype="bfloat16").run([r])[0]
    norm = model.model.norm if name == "tiny-gemma2" else model.transformer.ln_f
    final = _hf_final_rows(model, norm, r.tokens + r.continuations[0][:-1])
    _check_readout(got, _reference(final[len(r.tokens) - 1:], model), r.answers, r.continuations[0])

