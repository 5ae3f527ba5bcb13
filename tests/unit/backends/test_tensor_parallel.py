"""Tensor parallelism: reads of z gathered across ranks, writes landing on the rank that holds the head."""
from __future__ import annotations

import pytest
import torch

from patchgrid.model.tp import head_owner, heads_per_rank, merge_rank_captures, rank_z_columns, unit_owner


def test_heads_split_over_ranks():
    assert heads_per_rank(8, 2) == 4
    assert [unit_owner(n, 256, 2) for n in (0, 127, 128, 255)] == [(0, 0), (0, 127), (1, 0), (1, 127)]
    assert [head_owner(h, 8, 2) for h in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    assert [head_owner(h, 9, 3) for h in (2, 3, 8)] == [(0, 2), (1, 0), (2, 2)]
    assert rank_z_columns(1, 8, 64, 2) == slice(256, 512)
    with pytest.raises(ValueError, match="9 attention heads do not split over tensor_parallel_size 2"):
        heads_per_rank(9, 2)


def test_rank_reads_merge_into_whole_tensors():
    z = torch.arange(3 * 8 * 4, dtype=torch.float32).reshape(3, 32)  # 8 heads of 4
    resid = torch.randn(3, 16)
    neurons = torch.randn(3, 10)
    per_rank = [{"head.1": z[:, rank_z_columns(r, 8, 4, 2)], "resid.1": resid, "neuron.1": neurons[:, 5 * r:5 * r + 5]}
                for r in range(2)]
    merged = merge_rank_captures(per_rank)
    assert torch.equal(merged["head.1"], z) and torch.equal(merged["resid.1"], resid)
    assert torch.equal(merged["neuron.1"], neurons)
    assert merge_rank_captures(per_rank[:1])["head.1"].shape == (3, 16)

