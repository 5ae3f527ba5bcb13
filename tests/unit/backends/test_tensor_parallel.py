"""Tensor parallelism: reads of z gathered across ranks, writes landing on the rank that holds the head."""
from __future__ import annotations

import pytest
import torch

from patchgrid.model.tp import merge_rank_captures, units_per_rank


def test_heads_split_over_ranks():
    assert units_per_rank(8, 2) == 4 and units_per_rank(9, 3) == 3
    assert units_per_rank(256, 2, "MLP neurons") == 128
    with pytest.raises(ValueError, match="9 attention heads do not split over tensor_parallel_size 2"):
        units_per_rank(9, 2)
    with pytest.raises(ValueError, match="6 key/value heads do not split over tensor_parallel_size 4"):
        units_per_rank(6, 4, "key/value heads")


def test_rank_reads_merge_into_whole_tensors():
    z = torch.arange(3 * 8 * 4, dtype=torch.float32).reshape(3, 32)  # 8 heads of 4
    resid = torch.randn(3, 16)
    neurons = torch.randn(3, 10)
    per_rank = [{"head.1": z[:, 16 * r:16 * r + 16], "resid.1": resid, "neuron.1": neurons[:, 5 * r:5 * r + 5]}
                for r in range(2)]  # rank r: heads [4r, 4r + 4), each of 4 columns
    merged = merge_rank_captures(per_rank)
    assert torch.equal(merged["head.1"], z) and torch.equal(merged["resid.1"], resid)
    assert torch.equal(merged["neuron.1"], neurons)
    assert merge_rank_captures(per_rank[:1])["head.1"].shape == (3, 16)

