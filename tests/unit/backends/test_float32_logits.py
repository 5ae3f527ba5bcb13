"""The float32 unembedding's own arithmetic (backends/unembed.py) and the worker's reads of it, on
tensors made here: a large bf16 weight cast slice by slice to the same logits, a row's logits the same
whatever rows are unembedded with it, a weight that requires a gradient read as plain numbers, bf16
units used for bf16 inputs alone, a step's logits written into one reused buffer, and read rows kept
until they fill whole blocks. That the logits a request reads are float32 on both backends, against
the definition: tests/engine/backends/test_float32_logits.py.
"""
from __future__ import annotations

import pytest
import torch


def test_a_large_unembedding_is_cast_slice_by_slice_to_the_same_logits(monkeypatch):
    """Past KEEP_BYTES no wide copy is kept: the weight is cast SLICE_BYTES at a time, same product."""
    from patchgrid.backends import unembed

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 64, generator=g).to(torch.bfloat16)
    hidden, bias = torch.randn(3, 64, generator=g).to(torch.bfloat16), torch.randn(1000, generator=g)
    want = hidden.double() @ weight.double().T + bias.double()
    kept = unembed.unembed_float32(hidden, weight, bias)
    assert weight._patchgrid_float32[1].dtype == torch.float32
    monkeypatch.setattr(unembed, "KEEP_BYTES", 0)
    monkeypatch.setattr(unembed, "SLICE_BYTES", 64 * 4 * 300)  # 300 rows a slice: 4 slices, the last short
    copy = weight.clone()
    sliced = unembed.unembed_float32(hidden, copy, bias)
    assert not hasattr(copy, "_patchgrid_float32")  # no float32 copy of it kept
    torch.testing.assert_close(kept.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(sliced.double(), want, rtol=0, atol=1e-5)
    assert sliced.dtype == torch.float32 and kept.dtype == torch.float32 and sliced.shape == (3, 1000)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_logits_do_not_depend_on_the_other_rows_unembedded_with_it(dtype):
    """A float32 product's rounding changes with the number of rows multiplied at once (plain float32
    matmul here: row 0 alone differs from row 0 of two or more rows); the unembedding multiplies
    BLOCK_ROWS rows at a time, so a row's logits are the same whether it is read alone, with a few
    others or with hundreds, first or last; the answers' columns alone are the same numbers. In bf16
    (the bf16 units' product where the CPU has them) and in float32 (the float32 product: the tiny
    test models')."""
    from patchgrid.backends import unembed

    g = torch.Generator().manual_seed(1)
    weight = (0.05 * torch.randn(4096, 576, generator=g)).to(dtype)
    hidden = torch.randn(300, 576, generator=g).to(dtype)
    plain = [(hidden[:m].float() @ weight.float().T)[0] for m in (1, 2, 5, 300)]
    assert not all(torch.equal(p, plain[0]) for p in plain)  # the float32 product alone would differ
    every = unembed.unembed_float32(hidden, weight)
    for m in (1, 2, 5, 40, 129):
        assert torch.equal(unembed.unembed_float32(hidden[:m], weight), every[:m]), f"{m} rows"
    order = torch.randperm(300, generator=g)
    assert torch.equal(unembed.unembed_float32(hidden[order], weight), every[order])
    answers = torch.tensor([17, 4000])
    assert torch.equal(unembed.unembed_float32(hidden[:3], weight, columns=answers), every[:3, answers])
    assert torch.equal(unembed.unembed_float32(hidden[:1], weight, columns=answers[:1]), every[:1, answers[:1]])
    torch.testing.assert_close(every.double(), hidden.double() @ weight.double().T, rtol=0, atol=1e-5)


def test_a_weight_that_requires_a_gradient_is_read_without_one():
    """A plain module's weight (benchmarks/gpu_check's stand-in, a transformers model outside
    inference mode) requires a gradient; the read logits are numbers, not a graph."""
    from patchgrid.backends import unembed

    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(3, 16, generator=g)
    got = unembed.unembed_float32(hidden, head.weight, head.bias)
    assert not got.requires_grad
    torch.testing.assert_close(got, (hidden @ head.weight.T + head.bias).detach(), rtol=0, atol=1e-6)
    assert unembed.unembed_float32(hidden, head.weight, head.bias, columns=torch.tensor([4, 9])).shape == (3, 2)


def test_only_bf16_inputs_are_multiplied_on_bf16_units():
    """A CPU with bf16 units may multiply bf16 numbers there into float32 sums (exact products): the
    same numbers as the float32 product to float32 rounding. A float32 hidden state is not a bf16
    number, and rounding it to one would move a logit by about 1e-2 here: it is multiplied in float32.
    The setting is left as it was."""
    from patchgrid.backends import unembed

    g = torch.Generator().manual_seed(4)
    weight = (0.05 * torch.randn(2048, 576, generator=g)).to(torch.bfloat16)
    setting = torch.backends.mkldnn.matmul
    before = setting.fp32_precision
    for hidden in (torch.randn(130, 576, generator=g), torch.randn(130, 576, generator=g).to(torch.bfloat16)):
        got = unembed.unembed_float32(hidden, weight)
        torch.testing.assert_close(got.double(), hidden.double() @ weight.double().T, rtol=0, atol=1e-5)
        assert setting.fp32_precision == before
    hidden = torch.randn(130, 576, generator=g)
    rounded = hidden.to(torch.bfloat16).double() @ weight.double().T
    assert (rounded - hidden.double() @ weight.double().T).abs().max() > 1e-3  # what bf16 units would give it


def test_logits_written_into_a_scratch_buffer_are_the_same_and_reuse_it():
    """The worker writes each step's logits into one buffer (a fresh tensor of them is mapped and
    faulted in anew at every step on a CPU): the same numbers, and a step no larger than the
    largest before it takes no new memory."""
    from patchgrid.backends import unembed

    g = torch.Generator().manual_seed(5)
    weight = (0.05 * torch.randn(3000, 64, generator=g)).to(torch.bfloat16)
    hidden = torch.randn(200, 64, generator=g).to(torch.bfloat16)
    scratch = unembed.Scratch()
    first = unembed.unembed_float32(hidden, weight, scratch=scratch)
    assert torch.equal(first, unembed.unembed_float32(hidden, weight))
    buffer = scratch._buffer.data_ptr()
    second = unembed.unembed_float32(hidden[:7], weight, scratch=scratch)
    assert scratch._buffer.data_ptr() == buffer and second.data_ptr() == buffer
    assert torch.equal(second, unembed.unembed_float32(hidden[:7], weight))


def test_read_rows_are_kept_until_they_fill_whole_blocks_and_taken_by_whole_reads():
    """The worker keeps each step's read rows (readout.PendingReads) and takes them to be unembedded in
    whole blocks of rows, cut only between reads (a read's rows stay together), the rest kept for the
    next step; all of them when asked (a call's end); none while no block is full."""
    import numpy as np

    from patchgrid.backends.vllm_worker.readout import PendingReads
    from patchgrid.backends.vllm_worker.step import Step

    def step(plans, counts):
        s = Step()
        s.read_plans, s.read_count = np.array(plans), np.array(counts)
        s.read_first = np.zeros(len(plans), dtype=np.int64)
        return s

    pending = PendingReads()
    rows = torch.arange(12.0)[:, None]  # row r holds r: which rows were taken shows in their values
    pending.add(rows[:3], step([0, 1], [1, 2]))
    assert pending.take(4, everything=False) is None  # 3 rows: no block of 4 yet
    pending.add(rows[3:7], step([2, 3, 4], [2, 1, 1]))  # 7 rows: one block of 4, cut between reads
    hidden, reads = pending.take(4, everything=False)
    assert hidden[:, 0].tolist() == [0, 1, 2]  # plans 0 and 1: plan 2's two rows would cross the block
    assert reads.read_plans.tolist() == [0, 1] and reads.read_count.tolist() == [1, 2]
    hidden, reads = pending.take(4, everything=False)  # the next block: plans 2-4
    assert reads.read_plans.tolist() == [2, 3, 4] and hidden[:, 0].tolist() == [3, 4, 5, 6]
    assert pending.take(4, everything=False) is None
    pending.add(rows[7:12], step([5, 6], [4, 1]))
    hidden, reads = pending.take(4, everything=False)
    assert reads.read_plans.tolist() == [5] and hidden[:, 0].tolist() == [7, 8, 9, 10]
    assert pending.take(4, everything=False) is None
    hidden, reads = pending.take(4, everything=True)  # the call's end: what is left
    assert reads.read_plans.tolist() == [6] and hidden[:, 0].tolist() == [11]
    assert pending.rows == 0 and pending.take(4, everything=True) is None
    pending.add(torch.zeros(6, 1), step([7], [6]))  # a read of more rows than a block is taken whole, alone
    hidden, reads = pending.take(4, everything=False)
    assert reads.read_plans.tolist() == [7] and hidden.shape[0] == 6 and pending.rows == 0

