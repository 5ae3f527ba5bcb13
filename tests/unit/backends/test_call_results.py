"""A call's results as the vLLM worker keeps them (vllm_worker/results.py: arrays by plan) and as the
host reads them back into Results (backends/vllm_results.py), without vLLM: the worker's side filled
by hand as its readout fills it, across the plain-data boundary (`wire`, msgpack in multiprocess
mode). tests/engine/backends/test_engines_match_hf.py and test_answers.py hold the whole path to the hf
backend's numbers."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from patchgrid.backends.vllm_results import call_readings, call_results
from patchgrid.backends.vllm_worker.results import CallResults
from patchgrid.metrics import Reading
from patchgrid.plan import Patch, Request, encode_tensor, forwards

GRID = Request(tokens=(3, 4, 5), answers=(7, 8), patches=(Patch("resid", 1, "0:clean", (1,)),),
               continuations=((7,), (8,)), reference="0:clean")
LOGIT_DIFF_ONLY = Request(tokens=(3, 4, 5), answers=(7, 8), ranks=False)  # reads no vocabulary, no continuation
WHOLE = Request(tokens=(3, 4), answers=(7, 9), continuations=((7, 1, 2), (9, 6)), top_k=2)  # two forwards


def _call(requests):
    """The requests' forwards, and the call's plans: every request's forwards in order, (request, forward)."""
    fwds = [forwards(r) for r in requests]
    return fwds, [(r, f) for r, fs in zip(requests, fwds) for f in fs]


def _filled(plans) -> CallResults:
    """What the readout writes: plan k's answers k + 0.5, k + 1.5, ranks k, k + 1, logsumexp 10 + k, KL
    k / 10, its continuation tokens' log-probabilities -(k + 1), -(k + 2), ... in slot order."""
    width = max(len(r.answers) for r, _ in plans)
    res = CallResults(np.array([r.answers + (0,) * (width - len(r.answers)) for r, _ in plans], dtype=np.int64))
    for k, (r, f) in enumerate(plans):
        count = sum(len(r.continuations[j]) for j in f.scores)
        first = res.take(k, count)
        res.scores[first:first + count] = [-(k + 1 + i) for i in range(count)]
        res.filled[first:first + count] = True
        n = len(r.answers)
        res.answers[k, :n] = [k + 0.5 + i for i in range(n)]
        res.ranks[k, :n] = [k + i for i in range(n)]
        res.lse[k], res.kl[k] = 10 + k, k / 10
        res.finished(k, str(k), {"top_ids": [1, 2], "top_logits": [0.5, 0.25], "captures": {}} if r.top_k else None)
    return res


def _across_processes(wired: dict) -> dict:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(wired))


def test_each_request_reads_its_own_row_and_answers_scored_whole_join_their_forwards():
    requests = [GRID, LOGIT_DIFF_ONLY, WHOLE]
    fwds, plans = _call(requests)
    assert [len(fs) for fs in fwds] == [1, 1, 2]
    assert [f.scores for f in fwds[2]] == [(0,), (1,)]
    got = call_results(requests, fwds, [_across_processes(_filled(plans).wire())])

    grid, ld, whole = got
    assert grid.answer_logits.dtype == torch.float32 and grid.answer_logits.tolist() == [0.5, 1.5]
    assert grid.answer_ranks == [0, 1] and grid.logsumexp == 10 and grid.kl == pytest.approx(0.0)
    assert grid.continuation_logprobs == [[-1.0], [-2.0]]
    assert ld.answer_logits.tolist() == [1.5, 2.5] and ld.logsumexp is None and ld.answer_ranks == []
    assert ld.kl is None and ld.continuation_logprobs == []
    # plan 2, the first forward, reads the last prompt position and scores the first answer; plan 3 the second
    assert whole.answer_logits.tolist() == [2.5, 3.5] and whole.logsumexp == 12 and whole.answer_ranks == [2, 3]
    assert whole.top_ids == [1, 2] and whole.top_logits == [0.5, 0.25]
    assert whole.continuation_logprobs == [[-3.0, -4.0, -5.0], [-4.0, -5.0]]


def test_a_forward_never_finished_or_a_token_never_scored_is_an_error():
    requests = [GRID, GRID]
    fwds, plans = _call(requests)
    res = _filled(plans)
    res.done[1] = False
    with pytest.raises(RuntimeError, match="no result for 1 of 2 forwards"):
        call_results(requests, fwds, [res.wire()])
    res = _filled(plans)
    res.filled[1] = False
    with pytest.raises(RuntimeError, match="scored 1 of the call's 4 continuation tokens nowhere"):
        call_results(requests, fwds, [res.wire()])
    with pytest.raises(RuntimeError, match="the call had not begun"):
        call_results(requests, fwds, [None])


def test_readings_read_from_the_arrays_are_reading_of_each_result():
    """call_readings reads a grid's runs (two one-token answers, scored as continuations or not) from
    the arrays at once, and any other run from its Result: every reading is Reading.of of the run's
    Result, bit for bit, on numbers whose float32 difference rounds (random logits)."""
    requests = [GRID, LOGIT_DIFF_ONLY, WHOLE,
                Request(tokens=(3, 4, 5), answers=(7, 8), continuations=((7,), (8,))),  # no reference
                Request(tokens=(3, 4, 5), answers=(7, 8), continuations=((7,), (8,)), ranks=False),
                Request(tokens=(3, 4, 5), answers=(8, 7), reference="0:clean"),  # answers only, KL
                Request(tokens=(3, 4, 5), answers=(7, 8, 9), continuations=((7,), (8,))),  # three answers
                Request(tokens=(3, 4, 5), answers=(7, 8), continuations=((7,), (8,)), capture=("resid.0",)),
                GRID]
    fwds, plans = _call(requests)
    res = _filled(plans)
    g = torch.Generator().manual_seed(0)
    res.answers[:] = (torch.randn(res.answers.shape, generator=g) * 7).numpy()
    res.scores[:res.slots] = (-torch.rand(res.slots, generator=g, dtype=torch.float64) * 9).numpy()
    res.kl[:] = torch.rand(len(res.kl), generator=g, dtype=torch.float64).numpy()
    for k, (r, _) in enumerate(plans):
        if r.capture:  # the capturing run's own part
            res.parts[str(k)] = {"captures": {"resid.0": encode_tensor(torch.zeros(3, 2))}}
    wired = _across_processes(res.wire())
    want = [Reading.of(r) for r in call_results(requests, fwds, [wired])]
    got = call_readings(requests, fwds, [wired])
    assert got == want
    assert got[0].logit_diff == float(res.answers[0, 0] - res.answers[0, 1]) and got[0].kl == res.kl[0]
    assert got[1].logprob_diff is None and got[1].rank is None and got[1].kl is None
    assert got[4].rank is None and got[4].p is not None and got[5].logprob_diff is None
    assert got[2].logit_diff is None and len(got[2].logp_clean_tokens) == 3  # scored whole: from its Result
