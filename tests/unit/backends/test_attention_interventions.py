"""The attention arithmetic that pattern patches and knockouts are computed with on both backends
(backends/patterns.py), on random tensors: a knocked-out key gets weight exactly zero in the rows of
the blocked queries and the rest of each row renormalise in their ratios, grouped key/value heads
included, and `attend` is the pattern times the values. The interventions themselves, on a model,
against implementations written from their definitions: tests/engine/backends/test_attention_interventions.py.
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

