"""The read rows' logits in float32, whatever the model's dtype: both backends unembed here.

A row's logits are the final norm's output cast to float32 times the unembedding weight cast to
float32, plus the head's bias where it has one (GPT-J's lm_head), then the family's soft-cap where it
has one (Gemma 2's `final_logit_softcapping`: `sites.Family.final_softcap`). Only the read rows are
unembedded (one per request, plus the rows predicting a continuation's tokens), so the products are
cheap. A small unembedding's float64 copy is kept with the weight (at most `KEEP_BYTES`: smollm2-135m's
is 226 MB), since casting it again at every scheduler step costs more than the products; a larger one
is cast one slice of the vocabulary at a time, so that no wide copy of it is ever held: a call
then holds its float32 logits [rows, vocab] and one float64 slice of at most `SLICE_BYTES`. The product is
accumulated in float64 and rounded to float32: a float32 matrix product's rounding depends on how
many rows it multiplies at once (a step's read rows vary with the batch), float64's does only below
float32's last bit, so a row's logits do not depend on what else the step read (a study on Ray equals
the local run to the last bit). The tensors stay on the device the hidden state is on.
"""
from __future__ import annotations

import torch

SLICE_BYTES = 64 * 2**20  # the float64 copy of a large weight held at once: one slice of its rows
KEEP_BYTES = 256 * 2**20  # a weight whose float64 copy is at most this keeps it (an attribute of the weight)


def unembed_float32(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    columns: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [rows, d] (any dtype) @ weight [vocab, d].T (+ bias [vocab]), accumulated in float64:
    [rows, vocab] float32 on hidden's device; with `columns` (vocabulary ids), those columns alone:
    [rows, len(columns)]."""
    h = hidden.double()
    if columns is not None:
        out = h @ weight[columns].double().T
        if bias is not None:
            out += bias[columns].double()
        return out.float()
    kept = _kept_wide(weight)
    if kept is not None:
        out = h @ kept.T if bias is None else torch.addmm(bias.double(), h, kept.T)
        return out.float()
    vocab, d = weight.shape
    out = torch.empty(h.shape[0], vocab, dtype=torch.float32, device=h.device)
    step = max(1, SLICE_BYTES // (8 * d))
    for lo in range(0, vocab, step):
        part = h @ weight[lo:lo + step].double().T
        if bias is not None:
            part += bias[lo:lo + step].double()
        out[:, lo:lo + step] = part.float()
    return out


def _kept_wide(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in float64, kept with it while it is unchanged; None for a weight too large to keep."""
    if weight.dtype == torch.float64:
        return weight
    if weight.numel() * 8 > KEEP_BYTES:
        return None
    kept = getattr(weight, "_patchgrid_float64", None)
    if kept is None or kept[0] != weight._version:
        kept = (weight._version, weight.detach().double())
        weight._patchgrid_float64 = kept
    return kept[1]


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), as Gemma 2's forward (transformers and vLLM) caps its final logits;
    the logits unchanged without a cap."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap
