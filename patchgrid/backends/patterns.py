"""Attention patterns from the query and key attention reads, as the model's attention computes its
weights: scores q . k times the layer's scale, soft-capped (cap * tanh(score / cap)) where the model
caps them, masked causally and to the layer's sliding window (a key at least `window` positions back
is not read), softmaxed over the keys, in float32. Grouped key/value heads are shared by consecutive
query heads. The vLLM worker reads them from the kernel's q and k (vllm_worker.hooks), a prompt's
keys kept across the steps chunked prefill splits it into."""
from __future__ import annotations

import torch


def pattern_rows(query: torch.Tensor, key: torch.Tensor, first: int, scale: float, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """The weights [rows, heads, keys] of query rows [rows, heads, head_dim] at positions first.. over
    keys [keys, kv_heads, head_dim] at positions 0..; masked keys get exactly 0."""
    q, k = query.float(), key.float().repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = torch.einsum("thd,shd->ths", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    t = torch.arange(first, first + q.shape[0], device=q.device)[:, None, None]
    s = torch.arange(k.shape[0], device=q.device)[None, None, :]
    masked = s > t
    if window:
        masked = masked | (t - s >= window)
    return torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
