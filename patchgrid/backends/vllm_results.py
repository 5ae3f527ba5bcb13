"""A generate call's Results, read on the host from what the worker returned (`pg_end`: the call's
arrays by plan, vllm_worker.results.CallResults, and the parts of the forwards that read more). A
request run as one forward that captures nothing and asks for neither top_k nor log-probabilities,
a grid's patched run, has its Result read straight from its row of the arrays; any other is joined
from its forwards' parts as the hf backend joins them (plan.join_forwards).

`call_readings` reads a sweep's Readings instead (metrics.Reading.of of each Result): those of the
grid's runs, whose answers are one token each, straight from the arrays, many at once and with no
Result made; any other from its Result."""
from __future__ import annotations

import numpy as np
import torch

from ..metrics import Reading
from ..model.tp import merge_rank_captures
from ..plan import Result, decode_tensor, join_forwards
from .vllm_worker.results import decoded


def call_results(requests, fwds, per_rank: list) -> list[Result]:
    """Each request's Result: `fwds` its forwards (plan.forwards; the call's plans are every request's
    forwards in order, plan k the k-th: request.request_id), `per_rank` what pg_end returned on each
    tensor-parallel rank (rank 0 reads the logits; every rank holds its own slice of a capture, in
    the forward's part under its plan index)."""
    rows = _Rows(_checked(per_rank, fwds))
    parts = [rank["parts"] for rank in per_rank]
    out, k = [], 0
    for r, fs in zip(requests, fwds):
        out.append(_result(r, fs, k, rows, parts))
        k += len(fs)
    return out


def call_readings(requests, fwds, per_rank: list) -> list[Reading]:
    """Each request's Reading, metrics.Reading.of of its Result (call_results' arguments). A request
    run as one forward read from its row alone (`_plain`) whose two answers are one token each, and
    which scores them as its two continuations or scores none, is read from its row of the arrays with
    the others of its kind at once (Reading.one_token: the numbers Reading.of reads of its Result); any
    other from its Result."""
    arrays = _checked(per_rank, fwds)
    plan_of = np.cumsum([0] + [len(fs) for fs in fwds[:-1]])  # each request's first forward's plan
    quick, scored, referenced, ranked = [], [], [], []
    for i, (r, fs) in enumerate(zip(requests, fwds)):
        cs = r.continuations
        if (len(fs) == 1 and _plain(r) and len(r.answers) == 2
                and (not cs or (len(cs) == 2 and len(cs[0]) == 1 and len(cs[1]) == 1))):
            quick.append(i)
            scored.append(bool(cs))
            referenced.append(r.reference is not None)
            ranked.append(r.ranks)
    out: list = [None] * len(requests)
    if quick:
        ks = plan_of[quick]
        answers = arrays["answers"][ks]
        diffs = (answers[:, 0] - answers[:, 1]).tolist()  # in float32, as Reading.of subtracts them
        kls, ranks = arrays["kl"][ks].tolist(), arrays["ranks"][ks, 0].tolist()
        at = np.where(scored, arrays["score_start"][ks], -1)  # a clean answer's slot; the corrupt one's next
        scores = np.append(arrays["scores"], [np.nan, np.nan])  # slots -1 and 0 of a run that scores none
        cleans, corrupts = scores[at].tolist(), scores[at + 1].tolist()
        one_token = Reading.one_token
        for i, d, s, clean, corrupt, ref, kl, rk, rank in zip(quick, diffs, scored, cleans, corrupts, referenced, kls,
                                                                ranked, ranks):
            out[i] = one_token(d, clean if s else None, corrupt if s else None, kl if ref else None,
                               float(rank) if rk else None)
    if len(quick) < len(requests):
        rows = _Rows(arrays)
        parts = [rank["parts"] for rank in per_rank]
        for i, r in enumerate(requests):
            if out[i] is None:
                out[i] = Reading.of(_result(r, fwds[i], int(plan_of[i]), rows, parts))
    return out


def _plain(r) -> bool:
    """Whether request `r`, run as one forward, has its Result read from its row of the arrays alone."""
    return not r.capture and not r.top_k and not r.logprobs


def _checked(per_rank: list, fwds) -> dict[str, np.ndarray]:
    """The call's arrays (rank 0's), refused unless every forward finished and every continuation token
    was scored."""
    if per_rank[0] is None:
        raise RuntimeError("vLLM's worker returned no results: the call had not begun there")
    arrays = decoded(per_rank[0])
    n = sum(len(fs) for fs in fwds)
    done = arrays["done"]
    if len(done) != n or not done.all():
        raise RuntimeError(f"vLLM returned no result for {n - int(done[:n].sum())} of {n} forwards")
    if not arrays["filled"].all():
        missing = int((~arrays["filled"]).sum())
        raise RuntimeError(f"vLLM's worker scored {missing} of the call's {len(arrays['filled'])} continuation tokens "
                           "nowhere: their requests' answers were not scored in full")
    return arrays


def _result(r, fs, k: int, rows, parts: list[dict]) -> Result:
    """The Result of request `r`, whose forwards `fs` are the call's plans from k on."""
    if len(fs) == 1 and _plain(r):
        return rows.result(r, k)
    return join_forwards(r, fs, [_part(r, f, k + i, rows, parts) for i, f in enumerate(fs)])


class _Rows:
    """The call's arrays made Python lists once (each a C loop), and the answers' logits one float32
    tensor view per plan (`unbind`): per request, a Result then costs no numpy or torch call."""

    def __init__(self, arrays: dict):
        answers = arrays["answers"]
        self.width = answers.shape[1]
        self.answers = torch.from_numpy(answers).unbind(0)
        self.ranks = arrays["ranks"].tolist()
        self.lse, self.kl = arrays["lse"].tolist(), arrays["kl"].tolist()
        self.score_start, self.scores = arrays["score_start"].tolist(), arrays["scores"].tolist()

    def scored(self, r, js, k: int) -> list[list[float]]:
        """Forward k's log-probabilities of the tokens of continuations `js`, the ones it scores, in
        its order (each continuation's tokens from its first slot on)."""
        s, out = self.score_start[k], []
        for j in js:
            out.append(self.scores[s:s + len(r.continuations[j])])
            s += len(r.continuations[j])
        return out

    def first_reads(self, r, k: int) -> dict:
        """What forward k read at the last prompt position, as its request asks: the Result's fields."""
        n = len(r.answers)
        return {"answer_logits": self.answers[k] if n == self.width else self.answers[k][:n],
                "logsumexp": self.lse[k] if r.reads_vocabulary else None,
                "answer_ranks": self.ranks[k][:n] if r.ranks else [],
                "kl": self.kl[k] if r.reference is not None else None}

    def result(self, r, k: int) -> Result:
        """The Result of a request run as forward k alone (which scores every continuation, in order)."""
        return Result(continuation_logprobs=self.scored(r, range(len(r.continuations)), k), **self.first_reads(r, k))


def _part(r, f, k: int, rows: _Rows, parts: list[dict]) -> dict:
    """Forward k's part of its request's Result (plan.join_forwards): the arrays' row k, and what the
    forward's own part (its tag: k, as text) holds, its captures joined over tensor-parallel ranks."""
    tag = str(k)
    own = parts[0].get(tag, {})
    caps = {key: decode_tensor(v) for key, v in own.get("captures", {}).items()}
    if caps and len(parts) > 1:  # tensor parallel: each rank read its own slice of z
        caps = merge_rank_captures([caps] + [{key: decode_tensor(v) for key, v in rank[tag]["captures"].items()}
                                             for rank in parts[1:]])
    logprobs = own.get("logprobs")
    return {  # join_forwards reads the last prompt position's fields from the first forward's part alone
        **rows.first_reads(r, k), "top_ids": own.get("top_ids", []), "top_logits": own.get("top_logits", []),
        "logprobs": None if logprobs is None else decode_tensor(logprobs),
        "scores": dict(zip(f.scores, rows.scored(r, f.scores, k))), "captures": caps,
    }
