"""Attention patterns from the query and key attention reads, as the model's attention computes its
weights: scores q . k times the layer's scale, soft-capped (cap * tanh(score / cap)) where the model
caps them, masked causally and to the layer's sliding window (a key at least `window` positions back
is not read), softmaxed over the keys, in float32. Grouped key/value heads are shared by consecutive
query heads. The vLLM worker reads them from the kernel's q and k (vllm_worker.hooks), a prompt's
keys kept across the steps chunked prefill splits it into.

`attend` recomputes heads' outputs from such weights and the values: with some keys blocked (an
attention knockout: their scores set to minus infinity before the softmax, Geva et al. 2023), or
with one head's weights taken from another run (a pattern patch). Both backends write what it
returns in place of the heads' outputs (z, the output projection's input) at the rows it covers.
"""
from __future__ import annotations

import torch


def pattern_rows(query: torch.Tensor, key: torch.Tensor, first: int, scale: float, window: int | None = None,
                 softcap: float | None = None, blocked: torch.Tensor | None = None) -> torch.Tensor:
    """The weights [rows, heads, keys] of query rows [rows, heads, head_dim] at positions first.. over
    keys [keys, kv_heads, head_dim] at positions 0..; masked keys get exactly 0. `blocked` [rows, keys]
    (bool): keys each row may not read besides (a knockout), every head alike."""
    q, k = query.float(), key.float().repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = torch.einsum("thd,shd->ths", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    t = torch.arange(first, first + q.shape[0], device=q.device)[:, None, None]
    s = torch.arange(k.shape[0], device=q.device)[None, None, :]
    masked = s > t
    if window:
        masked = masked | (t - s >= window)
    if blocked is not None:
        masked = masked | blocked[:, None, :]
    return torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)


def attend(weights: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Heads' outputs [rows, heads, head_dim] in float32: weights [rows, heads, keys] applied to values
    [keys, kv_heads, head_dim] (grouped key/value heads shared by consecutive query heads)."""
    v = value.float().repeat_interleave(weights.shape[1] // value.shape[1], dim=1)
    return torch.einsum("ths,shd->thd", weights, v[:weights.shape[2]])


def blocked_keys(queries, keys, rows_first: int, n_rows: int, n_keys: int, device) -> torch.Tensor:
    """[n_rows, n_keys] bool: for query rows at positions rows_first.., True at the `keys` a knockout
    blocks where the row's position is one of its `queries`."""
    out = torch.zeros(n_rows, n_keys, dtype=torch.bool, device=device)
    rows = [q - rows_first for q in queries if 0 <= q - rows_first < n_rows]
    cols = [k for k in keys if k < n_keys]
    if rows and cols:
        out[torch.tensor(rows, device=device)[:, None], torch.tensor(cols, device=device)[None, :]] = True
    return out


def patched_head(weights: torch.Tensor, value: torch.Tensor, head: int, n_heads: int) -> torch.Tensor:
    """One head's outputs [rows, head_dim] in float32 under a pattern patch: that head's weights [rows,
    keys] (another run's) applied to this run's values [keys, kv_heads, head_dim]."""
    kv = head // (n_heads // value.shape[1])
    return attend(weights[:, None, :], value[:, kv:kv + 1])[:, 0]


def knocked_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q: int, blocked, scale: float,
                window: int | None, softcap: float | None) -> torch.Tensor:
    """Every head's output [1, heads * head_dim] in float32 at query position q (its query [heads,
    head_dim]) with the keys `blocked` knocked out, over this run's keys and values [keys, kv_heads,
    head_dim] at positions 0.. (those past q are not read)."""
    mask = blocked_keys((q,), blocked, q, 1, q + 1, query.device)
    w = pattern_rows(query[None], key[:q + 1], q, scale, window, softcap, mask)
    return attend(w, value).flatten(1)
