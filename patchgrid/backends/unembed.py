"""The read rows' logits in float32, whatever the model's dtype: both backends unembed here.

A row's logits are the final norm's output cast to float32 times the unembedding weight cast to
float32, plus the head's bias where it has one (GPT-J's lm_head), then the family's soft-cap where it
has one (Gemma 2's `final_logit_softcapping`: `sites.Family.final_softcap`). Only the read rows are
unembedded (one per request, plus the rows predicting a continuation's tokens), so the products are
cheap. A small unembedding's float32 copy is kept with the weight (at most `KEEP_BYTES`: smollm2-135m's
is 113 MB), since casting it again at every scheduler step costs more than the products; a larger one
is cast one slice of the vocabulary at a time, so that no float32 copy of it is ever held: a call
then holds its float32 logits [rows, vocab] and one slice of at most `SLICE_BYTES`. A weight already
in float32 is used as it is. The tensors stay on the device the hidden state is on.
"""
from __future__ import annotations

import torch

SLICE_BYTES = 64 * 2**20  # the float32 copy of a large weight held at once: one slice of its rows
KEEP_BYTES = 256 * 2**20  # a weight whose float32 copy is at most this keeps it (an attribute of the weight)


def unembed_float32(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [rows, d] (any dtype) @ weight [vocab, d].T (+ bias [vocab]), computed in float32:
    [rows, vocab] float32 on hidden's device."""
    h = hidden.float()
    kept = _kept_float32(weight)
    if kept is not None:
        return h @ kept.T if bias is None else torch.addmm(bias.float(), h, kept.T)
    vocab, d = weight.shape
    out = torch.empty(h.shape[0], vocab, dtype=torch.float32, device=h.device)
    step = max(1, SLICE_BYTES // (4 * d))
    for lo in range(0, vocab, step):
        out[:, lo:lo + step] = h @ weight[lo:lo + step].float().T
    if bias is not None:
        out += bias.float()
    return out


def _kept_float32(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in float32, kept with it while it is unchanged; None for a weight too large to keep."""
    if weight.dtype == torch.float32:
        return weight
    if weight.numel() * 4 > KEEP_BYTES:
        return None
    kept = getattr(weight, "_patchgrid_float32", None)
    if kept is None or kept[0] != weight._version:
        kept = (weight._version, weight.detach().float())
        weight._patchgrid_float32 = kept
    return kept[1]


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), as Gemma 2's forward (transformers and vLLM) caps its final logits;
    the logits unchanged without a cap."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap
