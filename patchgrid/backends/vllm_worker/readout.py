"""The logit readout: logits at every row from the last prompt position on, and what is read there.

vLLM unembeds each request's last row itself (a hook on its logits processor takes them), and a
hook on the final norm unembeds the rows before it; there the worker reads the answers' logits
and ranks, the continuations' log-probabilities, and the KL divergence from the reference
log-probabilities the call's sources hold. Batched over the step's rows.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from ...metrics import answer_ranks, kl_divergence
from ...plan import encode_tensor
from .step import Step


class LogitsReadout:
    """The logits hooks of a call (mixed into session.Session, whose state they read: `model`,
    `vocab`, `results`, and `step`, the current step's Step)."""

    _own_call = False  # while the final norm's hook unembeds its rows: the logits hook ignores them

    def _on_final(self, module, args, out):
        """Unembed the read rows vLLM will not: every one but each finishing request's last."""
        step = self.step
        if step.own_rows is None:
            return None
        hidden = out[0] if isinstance(out, tuple) else out
        self._own_call = True  # the logits hook below ignores this call
        try:
            step.own_logits = self.model.compute_logits(hidden[step.own_rows])
        finally:
            self._own_call = False
        return None

    def _on_logits(self, module, args, out):
        """vLLM's logits (one row per request of the step) beside the final norm's rows: every read
        row's readings, and the results of the requests that finish in this step."""
        step = self.step
        if self._own_call or not step.reads:
            return None
        if out is not None:  # None on tensor-parallel ranks but the first: logits live on rank 0
            n_read = sum(count for _, _, count in step.reads)
            logits = torch.empty(n_read, self.vocab, dtype=torch.float32, device=out.device)
            if step.vllm_rows is not None:
                logits[step.vllm_dest] = out[step.vllm_rows, : self.vocab].float()
            if step.own_logits is not None:
                logits[step.own_dest] = step.own_logits[:, : self.vocab].float()
            read(step, logits)
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
    rows = torch.tensor([f[0] for f in firsts], device=logits.device)
    first_logits, first_lse = logits[rows], lse[rows]
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
    """The KL divergence of each request with a reference from it (None without one)."""
    kls = [None] * len(firsts)
    with_ref = [k for k, (_, r) in enumerate(firsts) if r.reference is not None]
    if with_ref:
        refs = torch.stack([firsts[k][1].reference for k in with_ref])
        sel = torch.tensor(with_ref, device=first_logits.device)
        lp = first_logits[sel] - first_lse[sel, None]
        for k, v in zip(with_ref, kl_divergence(refs, lp).tolist()):
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
        sel = torch.tensor(ks, device=first_logits.device)
        tokens = torch.tensor([firsts[k][1].answers for k in ks], device=first_logits.device)
        vals = first_logits[sel].gather(1, tokens).tolist()
        ranks = answer_ranks(first_logits[sel], tokens).tolist()
        answers.update(zip(ks, zip(vals, ranks)))
    return answers
