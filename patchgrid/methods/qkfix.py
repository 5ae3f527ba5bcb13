"""AtP*'s QK fix (Kramár et al. 2024, arXiv 2403.00745, section 3.1.1): the effect of patching a
head's query or key estimated with its attention pattern recomputed exactly, linear only from the
pattern on.

With A the corrupt run's pattern of a head, dM/dA the metric's gradient with respect to it (at the
corrupt run) and A' the pattern recomputed with the patched query or key (the softmax of the
scaled, soft-capped where the model caps, causally masked scores, as the model's attention computes
them), the estimate is sum (A' - A) * dM/dA over the rows and keys the patch changes:

    query of head h at position t: row t of head h, recomputed with the clean query;
    key of key/value head g at s:  every row t >= s of every query head reading g, its score at s
                                   recomputed with the clean key and the row re-softmaxed;
    every position at once:        the whole pattern recomputed with every prompt position's clean
                                   queries (keys), the continuation's left corrupt.

dM/dA is read from the gradient at the head's output z (o_proj's input): z[t] = sum_s A[t, s] v[s],
so dM/dA[t, s] = dM/dz[t] . v[s], whatever kernel computed the attention. A key patched at one
position changes one score per row, so its re-softmaxed row has a closed form: with z the row's
scores, z' the new score at s, u = exp(z' - logsumexp(z)), r = 1 - A[t, s] (the weight on the other
keys) and o = sum_{j != s} A[t, j] dM/dA[t, j], the row's sum (A' - A) . dM/dA is
(u - A[t, s]) / (r + u) * (dM/dA[t, s] r - o); r and o are summed directly on a row's largest
weight, where 1 - A[t, s] would round a saturated row's remainder away.
Everything is computed in float64.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scores:
    """How a layer's attention turns q and k into scores (what transformers' attention is called with)."""

    scaling: float
    window: int | None = None  # attend only to the last `window` keys (sliding-window layers)
    softcap: float | None = None  # cap * tanh(score / cap) before the mask (Gemma 2)

    def __call__(self, query, key) -> torch.Tensor:
        """Masked scores [batch, heads, query rows, keys] of `query` [b, h, rows, d] against `key`
        [b, h, keys, d], the rows and keys being the forward's first positions."""
        scores = query @ key.transpose(-1, -2) * self.scaling
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        rows, keys = scores.shape[-2:]
        t = torch.arange(rows, device=scores.device)[:, None]
        s = torch.arange(keys, device=scores.device)[None, :]
        masked = s > t
        if self.window:
            masked = masked | (t - s >= self.window)
        return scores.masked_fill(masked, float("-inf"))


def _heads(flat: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[batch, tokens, heads * head_dim] -> [batch, heads, tokens, head_dim], in float64."""
    return flat.double().unflatten(2, (-1, head_dim)).transpose(1, 2)


def _rest(A, dA, n):
    """Per row t and key s < n: 1 - A[t, s] and sum_{j != s} A[t, j] dM/dA[t, j], the row's weight
    on the keys other than s, summed directly (not as a difference) where s is the row's largest
    weight: a saturated row's remainder is far below the rounding of 1."""
    top = torch.zeros_like(A, dtype=torch.bool).scatter_(-1, A.argmax(-1, keepdim=True), True)
    weighted = A * dA
    rest_top = A.masked_fill(top, 0).sum(-1, keepdim=True)
    others_top = weighted.masked_fill(top, 0).sum(-1, keepdim=True)
    a, is_top = A[..., :n], top[..., :n]
    rest = torch.where(is_top, rest_top, 1 - a)
    others = torch.where(is_top, others_top, weighted.sum(-1, keepdim=True) - weighted[..., :n])
    return rest, others


def qk_estimates(site: str, corrupt: dict, clean: torch.Tensor, grad_z: torch.Tensor, scores: Scores,
                 head_dim: int) -> torch.Tensor:
    """The QK-fixed estimates of `site` ("q" or "k") of one layer, [batch, n + 1, units]: per prompt
    position, then every position at once (units: query heads for q, key/value heads for k).

    corrupt: the corrupt forwards' "q", "k", "v" as attention reads them, [batch, tokens, heads *
    head_dim] (tokens: the forward's, the prompt's n first); clean: the clean prompts' q or k,
    [batch, n, ...]; grad_z: the metric's gradient at the layer's z, [batch, tokens, n_heads * head_dim]."""
    q, k, v = (_heads(corrupt[s], head_dim) for s in ("q", "k", "v"))
    rep = q.shape[1] // k.shape[1]  # query heads per key/value head (grouped-query attention)
    k_rep, v_rep = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    dA = _heads(grad_z, head_dim) @ v_rep.transpose(-1, -2)  # dM/dA [b, heads, rows, keys]
    logits = scores(q, k_rep)
    A = torch.softmax(logits, -1)
    patched = _heads(clean, head_dim)
    n = patched.shape[2]
    if site == "q":
        q_all = torch.cat([patched, q[:, :, n:]], 2)
        change = (torch.softmax(scores(q_all, k_rep), -1) - A) * dA  # rows t < n: each its query's patch
        per = change.sum(-1)[:, :, :n]  # [b, heads, n]
        every = per.sum(-1, keepdim=True)
        return torch.cat([per, every], -1).transpose(1, 2)
    k_clean = patched.repeat_interleave(rep, 1)
    # one key at s patched: each row's score at s recomputed, the row re-softmaxed (closed form)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    u = torch.exp(torch.clamp(scores(q, k_clean)[..., :n] - lse, max=60.0))  # masked scores: u = 0
    a, d = A[..., :n], dA[..., :n]
    rest, others = _rest(A, dA, n)
    denom = rest + u
    c = torch.where(denom > 0, (u - a) / denom.clamp_min(1e-300), 0.0)
    per = (c * (d * rest - others)).sum(-2)  # over the rows: [b, heads, n]
    k_all = torch.cat([k_clean, k_rep[:, :, n:]], 2)
    every = ((torch.softmax(scores(q, k_all), -1) - A) * dA).sum((-1, -2))[..., None]
    out = torch.cat([per, every], -1)  # [b, heads, n + 1]
    return out.unflatten(1, (-1, rep)).sum(2).transpose(1, 2)  # summed over the heads reading each key head


# The attention implementations the gradient model runs under: transformers' sdpa, or the model's
# eager attention where its scores are soft-capped, each handing q, k and v (after the rotary
# embedding: what the engine patches) to the Attributor's tap on the attention module first.
ATTENTION, ATTENTION_EAGER = "patchgrid_atp", "patchgrid_atp_eager"
TAP = "_patchgrid_atp_tap"  # the attribute of an attention module holding the Attributor's tap


def _tapped(module, query, key, value, kwargs):
    tap = getattr(module, TAP, None)
    if tap is None:
        return query, key, value
    return tap(query, key, value, Scores(kwargs.get("scaling") or query.shape[-1] ** -0.5,
                                         kwargs.get("sliding_window"), kwargs.get("softcap")))


def _sdpa_attention(module, query, key, value, *args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key, value = _tapped(module, query, key, value, kwargs)
    return sdpa_attention_forward(module, query, key, value, *args, **kwargs)


def _eager_attention(module, query, key, value, *args, **kwargs):
    query, key, value = _tapped(module, query, key, value, kwargs)
    return sys.modules[type(module).__module__].eager_attention_forward(module, query, key, value, *args, **kwargs)


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(ATTENTION, _sdpa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    AttentionInterface.register(ATTENTION_EAGER, _eager_attention)
    AttentionMaskInterface.register(ATTENTION_EAGER, eager_mask)


def tap_attention_method(module, method: str) -> None:
    """Route a family's own attention method (GPT-J: `_attn(query, key, value, mask)`) through the tap."""
    inner = getattr(module, method)

    def attend(query, key, value, *args, **kwargs):
        query, key, value = _tapped(module, query, key, value, {"scaling": 1.0 / float(module.scale_attn)})
        return inner(query, key, value, *args, **kwargs)

    setattr(module, method, attend)
