"""The read rows' logits in float32, whatever the model's dtype: both backends unembed here.

A row's logits are the final norm's output cast to float32 times the unembedding weight cast to
float32, plus the head's bias where it has one (GPT-J's lm_head), then the family's soft-cap where it
has one (Gemma 2's `final_logit_softcapping`: `sites.Family.final_softcap`). Only the read rows are
unembedded (one per request, plus the rows predicting a continuation's tokens). A model in bf16 or
float16 computes its own logits in its dtype; these are finer (its bf16 inputs multiply exactly in
float32, and the sum keeps float32's precision). Where the hidden state and the weight are both bf16,
a CPU with bf16 units (AMX, AVX-512 BF16) multiplies them on those units into float32 sums
(`_bf16_units`): the same exact products, about three times as fast as the float32 product on AMX.

On vLLM the product is taken `BLOCK_ROWS` rows at a time, the last block filled up with zero rows,
so that every product has the same shape whatever the number of rows a step reads: a matrix
product's rounding depends on its shape (a float32 BLAS takes another path for one row, or a few,
than for many), not on a row's place in it, so a row's logits do not depend on what else its step
read, and a study on Ray equals the local run to the last bit. vLLM's worker keeps a call's read rows
from step to step until they fill whole blocks (vllm_worker.readout.PendingReads): a block is filled
up only at the call's end and where a request that holds more finishes. Likewise the answers' columns alone
(`columns`) are computed as at least `MIN_COLUMNS` columns, so that they round as the whole
vocabulary's product does: a product of one column is a matrix-vector product, and on an AMD EPYC
with AVX-512 a product of 8 columns took another path than the whole vocabulary's, where 16 and
more took the same. This is checked on the machine that runs the tests
(tests/engine/backends/test_float32_logits.py), not promised by BLAS. The Hugging Face backend multiplies a
forward's rows at once (`block_rows=None`): its forward's own rounding already depends on its batch,
and a block would make its one-request forwards pay for 128 rows.

A small unembedding's float32 copy is kept with the weight (at most `KEEP_BYTES`: smollm2-135m's is
113 MB), since casting it again at every scheduler step costs more than the products; a larger one
is cast one slice of the vocabulary at a time (`SLICE_BYTES`, the same slices at every call), so that
no wide copy of it is ever held. The tensors stay on the device the hidden state is on.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

BLOCK_ROWS = 128  # rows unembedded by one product (the last block filled up with zero rows)
MIN_COLUMNS = 64  # the answers' columns alone are computed as at least this many (the first repeated)
SLICE_BYTES = 64 * 2**20  # the float32 copy of a large weight held at once: one slice of its rows
KEEP_BYTES = 256 * 2**20  # a weight whose float32 copy is at most this keeps it (an attribute of the weight)


def unembed_float32(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    columns: torch.Tensor | None = None, block_rows: int | None = BLOCK_ROWS,
                    scratch: Scratch | None = None) -> torch.Tensor:
    """hidden [rows, d] (any dtype) @ weight [vocab, d].T (+ bias [vocab]) in float32, `block_rows`
    rows a product (None: every row in one): [rows, vocab] float32 on hidden's device; with `columns`
    (vocabulary ids), those columns alone: [rows, len(columns)]. Read, not differentiated: no
    gradient flows through it, even from a weight that requires one. With `scratch`, the logits of
    the whole vocabulary are written into its buffer: they last until its next use."""
    block = block_rows or max(1, hidden.shape[0])
    h = _blocks(hidden.float(), block)
    bf16 = hidden.dtype == weight.dtype == torch.bfloat16
    if columns is not None:
        n = len(columns)
        wide = torch.cat([columns, columns[:1].expand(max(0, MIN_COLUMNS - n))]) if n else columns
        out = _product(h, weight[wide].float(), None if bias is None else bias[wide].float(), block, bf16)[:, :n]
        return out[: hidden.shape[0]]
    vocab, d = weight.shape
    out = (torch.empty(h.shape[0], vocab, dtype=torch.float32, device=h.device) if scratch is None
           else scratch.take(h.shape[0], vocab, h.device))
    kept = _kept_float32(weight)
    if kept is not None:
        return _product(h, kept, None if bias is None else bias.float(), block, bf16, out)[: hidden.shape[0]]
    step = max(1, SLICE_BYTES // (4 * d))
    for lo in range(0, vocab, step):
        out[:, lo:lo + step] = _product(h, weight[lo:lo + step].float(),
                                        None if bias is None else bias[lo:lo + step].float(), block, bf16)
    return out[: hidden.shape[0]]


def _blocks(h: torch.Tensor, block: int) -> torch.Tensor:
    """h [rows, d] with zero rows appended up to a multiple of `block`."""
    pad = -h.shape[0] % block
    return torch.cat([h, h.new_zeros(pad, h.shape[1])]) if pad else h


def _product(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, block: int,
             bf16: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """h [k * block, d] @ w [n, d].T (+ bias [n]), one `block`-row product at a time, into `out`
    [k * block, n] float32 (a new tensor if None); `bf16`: every input a bf16 number, so a CPU with
    bf16 units may multiply them as bf16 into float32 sums."""
    if out is None:
        out = torch.empty(h.shape[0], w.shape[0], dtype=torch.float32, device=h.device)
    h, wt = h.detach(), w.detach().T  # torch's out= products take no tensor that requires a gradient
    with _bf16_units(bf16 and h.device.type == "cpu"):
        for lo in range(0, h.shape[0], block):
            torch.mm(h[lo:lo + block], wt, out=out[lo:lo + block])
    return out if bias is None else out.add_(bias.detach())


@contextmanager
def _bf16_units(allowed: bool):
    """Let oneDNN multiply float32 matrices on the CPU's bf16 units (AMX or AVX-512 BF16) for the
    duration: it rounds each input to bf16 and sums the products in float32. Allowed only when every
    input already is a bf16 number, where the rounding changes nothing: the product is then a float32
    sum of exact products, as the float32 product's is, at about 2.6 times its speed on AMX (smollm2's
    unembedding, 128 rows). Where the CPU has no bf16 units oneDNN keeps the float32 product."""
    setting = torch.backends.mkldnn.matmul
    before = setting.fp32_precision
    if allowed:
        setting.fp32_precision = "bf16"
    try:
        yield
    finally:
        setting.fp32_precision = before


class Scratch:
    """A float32 buffer the logits of the whole vocabulary are written into, reused from one use to
    the next (the worker keeps one for a call): a new tensor of a step's logits (tens to hundreds of
    MB) is mapped afresh by the C library at every step past its mmap threshold (32 MB at most, glibc)
    and each of its pages faulted in, which on a CPU cost about as much as the product itself
    (smollm2, 256 rows: 52 ms against 28). What it holds lasts until its next use. It keeps the
    largest it was asked for."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None

    def take(self, rows: int, cols: int, device) -> torch.Tensor:
        """A [rows, cols] float32 tensor on `device`, its values whatever they were."""
        need = rows * cols
        b = self._buffer
        if b is None or b.numel() < need or b.device != torch.device(device):
            b = self._buffer = torch.empty(need, dtype=torch.float32, device=device)
        return b[:need].view(rows, cols)


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
