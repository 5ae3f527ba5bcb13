"""What a run is measured by, and how an effect is turned into a recovery.

Every run is read at its last prompt position, and its answers are scored after it (teacher-forced
over every token of an answer, `Request.continuations`):

    logit_diff     logit(clean answer) - logit(corrupt answer) at the last prompt position; one-token
                   answers only (a pair whose answers are scored whole has none)
    logprob_diff   log p(clean answer) - log p(corrupt answer), each summed over its tokens. For
                   one-token answers both log-probabilities share the last position's normaliser,
                   so this equals logit_diff (up to float rounding); for longer answers each token
                   has its own normaliser and the two differ.
    logp_clean     log p(clean answer), summed over its tokens
    logp_corrupt   log p(corrupt answer), summed over its tokens
    p              p(clean answer): the product over its tokens, exp(logp_clean)
    kl             KL(clean run || this run) of the next-token distributions at the last prompt
                   position, in nats: 0 for the clean run itself
    rank           how many tokens have a larger logit than the clean answer's first token at the
                   last prompt position (0: it is the top token)

A run reads only what its metrics need (`Metric.reads`: the answers' logits, the continuations'
log-probabilities, the KL reference, the answers' ranks): a study's `metrics` setting chooses them, and
a metric it leaves out is NULL in the effect rows of its patched runs (no row of that metric in the
warehouse's views). Every metric but logit_diff needs the whole vocabulary unembedded at the read
row; logit_diff alone needs only the answers' two columns.

Each metric has a direction (`better`: +1 when the clean run's value is the larger, -1 when the
smaller) and, where a ratio means something, a recovery. Effect rows carry every metric's patched,
clean and corrupt value (`patched_<metric>`, ...); the warehouse's views turn them into one row
per metric. To add a metric: its entry in `METRICS`, a field of `Reading` filled in `Reading.of`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from .frozen import frozen

if TYPE_CHECKING:  # imported where it is used: the light commands read METRICS and need no torch
    import torch


@dataclass(frozen=True)
class Metric:
    meaning: str
    better: int  # +1: the clean run's value is the larger; -1: the smaller
    # A recovery divides by the span clean - corrupt. Where better x span is smaller than this
    # (or negative, which --no-require-known allows), the ratio is noise: the pair is left out of
    # the recovery averages (and counted there as n_small_span); its effect is still averaged.
    # None: the metric has no recovery (a ratio of ranks means nothing).
    min_span: float | None
    # What a run must read for it (plan.Request): `answers` (the answers' logits at the last prompt
    # position), `continuations` (each answer scored whole), `reference` (the clean run's
    # log-probabilities, for KL) or `ranks` (the answers' ranks over the vocabulary)
    reads: str = "answers"


METRICS = {
    "logit_diff": Metric("logit(clean answer) - logit(corrupt answer) at the last prompt position (one-token "
                         "answers)", +1, 0.5, "answers"),
    "logprob_diff": Metric("log p(clean answer) - log p(corrupt answer), each summed over its tokens", +1, 0.5,
                           "continuations"),
    "logp_clean": Metric("log p(clean answer), summed over its tokens", +1, 0.5, "continuations"),
    "logp_corrupt": Metric("log p(corrupt answer), summed over its tokens", -1, 0.5, "continuations"),
    "p": Metric("probability of the clean answer (the product over its tokens)", +1, 0.02, "continuations"),
    "kl": Metric("KL divergence (nats) from the clean run's next-token distribution to this run's at the last "
                 "prompt position", -1, 0.1, "reference"),
    "rank": Metric("rank of the clean answer's first token at the last prompt position (0: the top token)", -1, None,
                   "ranks"),
}


def reads_of(metrics) -> frozenset[str]:
    """What a run must read for `metrics` (names in METRICS): their Metric.reads."""
    return _reads(tuple(metrics))


@functools.lru_cache(maxsize=256)
def _reads(metrics: tuple[str, ...]) -> frozenset[str]:
    return frozenset(METRICS[m].reads for m in metrics)


@frozen
class Reading:
    """One run's value on every metric (a trace row's: the mean over noise samples)."""

    logit_diff: float | None  # None: an answer of several tokens
    logprob_diff: float | None  # None (here and below): the run did not read it (the `metrics` setting)
    logp_clean: float | None
    logp_corrupt: float | None
    p: float | None
    kl: float | None  # None also: no clean distribution to compare with
    rank: float | None
    logp_clean_tokens: tuple[float, ...] = ()
    logp_corrupt_tokens: tuple[float, ...] = ()

    @classmethod
    def of(cls, result, kl: float | None = None) -> Reading:
        """From an engine Result whose answers are (clean first token, corrupt first token) and whose
        continuations are (clean answer, corrupt answer), or none where the run scored no answer
        whole (its answers' first tokens then stand for them: logit_diff's one-token case);
        `kl` when the result has none. What the run did not read is None."""
        kl = result.kl if result.kl is not None else kl
        rank = float(result.answer_ranks[0]) if result.answer_ranks else None
        if not result.continuation_logprobs:
            return cls.one_token(_difference(result.answer_logits), None, None, kl, rank)
        clean, corrupt = result.continuation_logprobs  # (clean answer, corrupt answer)
        clean, corrupt = tuple(map(float, clean)), tuple(map(float, corrupt))
        if len(clean) == 1 and len(corrupt) == 1:
            return cls.one_token(_difference(result.answer_logits), clean[0], corrupt[0], kl, rank)
        lp_clean, lp_corrupt = math.fsum(clean), math.fsum(corrupt)
        return cls(None, lp_clean - lp_corrupt, lp_clean, lp_corrupt, math.exp(lp_clean), kl, rank, clean, corrupt)

    @classmethod
    def one_token(cls, logit_diff: float, clean: float | None, corrupt: float | None, kl: float | None,
                  rank: float | None) -> Reading:
        """The reading of a run whose answers are one token each: `logit_diff` (their logits'
        difference, in float32), their log-probabilities `clean` and `corrupt` (None: the run scored
        no continuation), `kl` and `rank` (None: not read). What `of` makes of such a run's Result,
        from its numbers alone (backends.vllm_results reads many at once from a call's arrays)."""
        if clean is None:
            return cls(logit_diff, None, None, None, None, kl, rank)
        return cls(logit_diff, clean - corrupt, clean, corrupt, math.exp(clean), kl, rank, (clean,), (corrupt,))

    def only(self, metrics) -> Reading:
        """This reading with every metric but `metrics` None (a per-token list with its metric)."""
        keep = set(metrics)
        out = {m: getattr(self, m) if m in keep else None for m in METRICS}
        out["logp_clean_tokens"] = self.logp_clean_tokens if "logp_clean" in keep else ()
        out["logp_corrupt_tokens"] = self.logp_corrupt_tokens if "logp_corrupt" in keep else ()
        return Reading(**out)

    def value(self, metric: str) -> float | None:
        return getattr(self, metric)

    @staticmethod
    def mean(readings: list[Reading]) -> Reading:
        """Field by field (token lists token by token); None where any reading has none."""
        out = {}
        for f in fields(Reading):
            vals = [getattr(r, f.name) for r in readings]
            if f.name.endswith("_tokens"):
                out[f.name] = tuple(sum(col) / len(col) for col in zip(*vals))
            else:
                out[f.name] = None if any(v is None for v in vals) else sum(vals) / len(vals)
        return Reading(**out)


def _difference(logits) -> float:
    """logits[0] - logits[1] of a float32 tensor, subtracted in float32 (as the tensors would) on
    numpy's scalars: a tensor operation per run costs microseconds."""
    import numpy as np

    a, b = logits.tolist()[:2]
    return float(np.float32(a) - np.float32(b))


def recovery(patched: float | None, clean: float | None, corrupt: float | None) -> float | None:
    """(patched - corrupt) / (clean - corrupt): 1 when the patch restores the clean value, 0 when it
    does nothing; None when clean and corrupt are equal and the ratio is undefined."""
    if patched is None or clean is None or corrupt is None:
        return None
    span = clean - corrupt
    return None if span == 0 else (patched - corrupt) / span


def kl_divergence(reference: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(reference || run) in nats over the last dimension, from log-probabilities: summed in float64
    and returned in float32, so that the order of the sum never shows. The one definition every
    backend (and the baselines) computes KL with; `KlReference` is the same sum rearranged for many
    rows against one reference."""
    ref = reference.double()
    return (ref.exp() * (ref - logprobs.double())).sum(-1).float()


class KlReference:
    """One reference distribution (log-probabilities [vocab]) prepared once for the KL divergence of
    many rows from it: KL(ref || lp) = sum p (ref - lp) with p = exp(ref) taken once, not once per
    row, and the sum one float64 product per row. The rows' log-probabilities are rounded to float32
    first, as a Result's are, and every term is kl_divergence's, so the two agree to float32's last
    bit, and a row equal to the reference reads exactly 0. Worked through a few rows at a time
    (`row_chunks`)."""

    def __init__(self, logprobs: torch.Tensor):
        self.ref = logprobs.double()
        self.p = self.ref.exp()

    def kl(self, logits: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """logits [n, vocab] float32 and their logsumexp [n] -> KL [n] float32; with `rows` (row
        indices), of those rows alone [len(rows)], taken a chunk at a time (no copy of them all)."""
        import torch

        if rows is not None:
            lse = lse[rows]
        out = torch.empty(lse.shape[0], dtype=torch.float64, device=logits.device)
        for at, chunk in chunked(logits, rows):
            d = (chunk - lse[at, None]).double()
            d.neg_().add_(self.ref)  # ref - lp, in place: no second float64 tensor
            torch.mv(d, self.p, out=out[at])
        return out.float()


def answer_ranks(logits: torch.Tensor, tokens, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, how many entries of `logits` are larger than its own (0: the top one):
    logits [..., vocab], tokens [..., k] -> [..., k]; with `rows` (indices of rows of logits
    [n, vocab]), tokens [len(rows), k] are those rows' (no copy of them all). One comparison per
    answer over the vocabulary, a few rows at a time (`row_chunks`), written as 1.0 or 0.0 and
    summed in float32: whole numbers below 2**24 add exactly in any order, and torch sums floats on
    a CPU's vector units where it sums booleans one at a time (about 3.5 times the speed on
    smollm2's vocabulary)."""
    import torch

    tokens = torch.as_tensor(tokens, device=logits.device)
    shape = tokens.shape
    flat = logits.reshape(-1, logits.shape[-1])  # the leading dimensions as rows
    tokens = tokens.reshape(flat.shape[0] if rows is None else len(rows), -1)
    vals = flat.gather(-1, tokens) if rows is None else flat[rows[:, None], tokens]
    exact = torch.float32 if flat.shape[-1] < 2**24 else torch.float64  # every count a whole float
    out = torch.empty(vals.shape, dtype=exact, device=logits.device)
    for at, chunk in chunked(flat, rows):
        above = torch.empty(chunk.shape, dtype=exact, device=logits.device)
        for k in range(vals.shape[1]):
            torch.gt(chunk, vals[at, k:k + 1], out=above)
            torch.sum(above, -1, out=out[at, k])
    return out.to(torch.int32).reshape(shape)


def logsumexp_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> the logsumexp of each row [rows], a few rows at a time (`row_chunks`).
    A lone row is reduced beside a copy of itself: torch splits a reduction with a single output
    across its threads, which rounds it otherwise, so a row's logsumexp would depend on whether it
    was read alone."""
    import torch

    parts = []
    for rows in row_chunks(logits):
        x = logits[rows]
        parts.append(torch.logsumexp(x.repeat(2, 1) if x.shape[0] == 1 else x, 1)[: x.shape[0]])
    return torch.cat(parts)


CPU_CHUNK_BYTES = 2 * 2**20  # on a CPU, the float64 rows the readout's reductions take at once


def chunked(logits: torch.Tensor, rows: torch.Tensor | None = None):
    """(slice of the rows read, those rows of logits) a chunk at a time (`row_chunks`): every row of
    logits [n, vocab], as views; with `rows` (row indices), those rows in their order, each chunk
    gathered on its own (a few rows copied at a time, never all of them)."""
    if rows is None:
        for at in row_chunks(logits):
            yield at, logits[at]
        return
    for at in row_chunks(logits, len(rows)):
        yield at, logits.index_select(0, rows[at])


def row_chunks(logits: torch.Tensor, n: int | None = None) -> list[slice]:
    """Slices of the rows of logits [rows, vocab] to reduce one after another. On a CPU, each about
    CPU_CHUNK_BYTES of float64 (two rows at least, a lone last row joined to the one before): a
    few rows of a large vocabulary, whose temporaries stay in the core's cache through an operation's
    passes, where those of a whole step's rows would go to memory (and, past glibc's mmap
    threshold, be mapped afresh at every step). Elsewhere (a GPU) one slice of every row. `n`: the
    number of rows read, when not every row of logits (rows of its width)."""
    n = logits.shape[0] if n is None else n
    if logits.device.type != "cpu" or n <= 2:
        return [slice(0, n)]
    per = max(2, CPU_CHUNK_BYTES // (8 * logits.shape[-1]))
    starts = list(range(0, n, per))
    if n - starts[-1] == 1:
        starts.pop()
    return [slice(lo, hi) for lo, hi in zip(starts, starts[1:] + [n])]
