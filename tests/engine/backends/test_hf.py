"""The reference backend's own offers: the attention pattern, read where transformers computes
attention."""
from __future__ import annotations

import pytest
import torch

from patchgrid.plan import Request
from tests.support.engines import TINY


@pytest.mark.parametrize("model", TINY + ("tiny-gemma2", "tiny-gemma3", "tiny-gptj", "tiny-neox", "tiny-olmo2"))
def test_the_pattern_equals_transformers_eager_attention_weights(engines, model):
    """Gemma's sliding windows (8 tokens, shorter than the prompt) and soft-capped scores included;
    GPT-J's read in its own attention method."""
    from transformers import AutoModelForCausalLM

    hf = engines.get(model, "hf", dtype="float32")
    tokens = (21, 7, 143, 88, 301, 12, 9, 40, 77, 5, 260, 31)
    n, heads = len(tokens), hf.shape.n_heads
    got = hf.run([Request(tokens=tokens, capture=tuple(f"pattern.{layer}" for layer in range(hf.shape.n_layers)))])[0]
    eager = AutoModelForCausalLM.from_pretrained(hf.folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = eager(input_ids=torch.tensor([tokens]), output_attentions=True).attentions
    for layer in range(hf.shape.n_layers):
        pattern = got.captures[f"pattern.{layer}"]
        assert pattern.shape == (n, heads * n)  # per query token: every head's weights over the key tokens
        per_head = pattern.view(n, heads, n).transpose(0, 1)  # [heads, query, key]
        assert torch.allclose(per_head, want[layer][0], atol=1e-5)
        assert torch.allclose(per_head.sum(-1), torch.ones(heads, n), atol=1e-5)
        assert (per_head.triu(1) == 0).all()  # causal
