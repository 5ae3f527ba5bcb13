"""Tensor parallelism: how heads of z and neurons of the MLP split over ranks, and putting per-rank
reads back together.

With tensor_parallel_size > 1, vLLM splits attention by heads: rank r holds heads
[r * n/tp, (r+1) * n/tp) and its o_proj (row-parallel) input is only that slice of z. It splits
the MLP the same way by neurons: rank r's down projection (row-parallel) reads neurons
[r * d_mlp/tp, (r+1) * d_mlp/tp). Queries split with the heads, keys and values with the key/value
heads (a model with fewer key/value heads than ranks replicates them, and its k and v sites are
refused here). The other sites (embed, resid, attn_out, mlp_out) come after an
all-reduce and are whole on every rank, so a write there is the same on every rank and a read is
taken from rank 0.
"""
from __future__ import annotations

import torch

from .sites import SITES, parse_key

SPLIT_WIDTHS = ("z", "q", "kv", "mlp")  # Site.width values split over ranks by unit


def units_per_rank(units: int, tp_size: int, what: str = "attention heads") -> int:
    """How many of `units` (heads or neurons, as `what` names them) each of `tp_size` ranks holds."""
    if units % tp_size:
        raise ValueError(f"{units} {what} do not split over tensor_parallel_size {tp_size}")
    return units // tp_size


def merge_rank_captures(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole tensors from each rank's reads: z, q, k, v and neuron slices side by side in rank order,
    the rest from rank 0."""
    out = dict(per_rank[0])
    for key in out:
        if SITES[parse_key(key)[0]].width in SPLIT_WIDTHS and len(per_rank) > 1:
            out[key] = torch.cat([caps[key] for caps in per_rank], dim=1)
    return out
