"""Pattern patching and attention knockout, each against an implementation written here from its
definition on a plain transformers model. vLLM is held to the hf backend on every family by the
requests tests.support.backends.attention_requests adds to every site's (test_vllm_matches_hf on the
suite's three models; test_families on the others, chunked prefill and the multiprocess executor
among them).

- A pattern patch (TransformerLens's get_act_patch_attn_head_pattern_*) replaces one head's weights
  by the other run's and keeps this run's values: its output is the source's pattern times this
  run's values, which the head site then writes (an independent route: the head patch).
- A knockout (Geva et al. 2023) blocks attention edges before the softmax: here transformers' own
  eager attention runs with its mask raised to minus infinity at the blocked (query, key) cells in
  the layers of the window, and the patched model's answers must match the backend's.
"""
from __future__ import annotations

import torch

from patchgrid.backends.patterns import attend, blocked_keys, pattern_rows


def test_a_knocked_out_key_gets_weight_exactly_zero_and_the_rest_renormalise():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g)  # grouped: 2 kv heads
    free = pattern_rows(q, k, 4, 0.35)
    blocked = blocked_keys((5, 6), (1, 3, 6), 4, 3, 7, q.device)
    w = pattern_rows(q, k, 4, 0.35, blocked=blocked)
    assert (w[1:, :, [1, 3]] == 0).all() and (w[2, :, 6] == 0).all()  # rows at positions 5 and 6 only
    assert torch.equal(w[0], free[0])
    assert torch.allclose(w.sum(-1), torch.ones(3, 4), atol=1e-6)
    # the rest keep their ratios: renormalised over the keys left
    kept = free[1][:, [0, 2, 4, 5]]
    assert torch.allclose(w[1][:, [0, 2, 4, 5]], kept / kept.sum(-1, keepdim=True), atol=1e-6)
    v = torch.randn(7, 2, 8, generator=g)
    z = attend(w, v)
    want = torch.einsum("ths,shd->thd", w, v.repeat_interleave(2, dim=1))
    assert torch.allclose(z, want, atol=1e-6)

