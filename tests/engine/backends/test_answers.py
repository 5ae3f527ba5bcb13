"""Answers of any length and every metric: vLLM gives the Hugging Face reference's numbers, and
both give what a plain forward over the prompt followed by the answer gives."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from patchgrid.metrics import Reading
from patchgrid.plan import LOGPROBS, Noise, Patch, PlanError, Request, Start, forwards, tree_len
from tests.support.backends import all_keys, assert_results_close
from tests.support.engines import needs_vllm

pytestmark = needs_vllm

CLEAN = (21, 7, 143, 88, 301, 12, 9, 40)
CORRUPT = (21, 7, 250, 61, 301, 12, 9, 40)
ONE = ((5,), (77,))  # one-token answers
LONG = ((5, 9, 33), (77, 4))  # both answers several tokens: one forward each
MIXED = ((5, 9, 33), (77,))  # one of several tokens, one scored at the last prompt position


def scored_requests(shape, tokens, continuations, source="clean"):
    """Unpatched, patched before and at the last prompt token, over every position, noised, and
    a head; every request with its KL reference."""
    n = len(tokens)
    answers = tuple(c[0] for c in continuations)
    common = dict(answers=answers, continuations=continuations, reference="ref")
    reqs = [Request(tokens=tokens, top_k=5, logprobs=True, **common)]
    for layer in (0, shape.n_layers - 1):
        for positions in ((2,), (n - 1,), None):
            reqs.append(Request(tokens=tokens, patches=(Patch("resid", layer, source, positions),), **common))
        reqs.append(Request(tokens=tokens, patches=(Patch("head", layer, source, (n - 1,), 1),), **common))
    reqs.append(Request(tokens=tokens, noise=(Noise((2, 3), 0.7, 11),), **common))
    reqs.append(Request(tokens=tokens, patches=(Patch("mlp_out", 1, source, (3,)),), capture=("resid.1",), **common))
    return reqs


def _sources(engine, continuations):
    answers = tuple(c[0] for c in continuations)
    clean = engine.run([Request(tokens=CLEAN, answers=answers, continuations=continuations,
                                capture=tuple(all_keys(engine.shape, pattern=False)), logprobs=True)])[0]
    return {"clean": clean.captures, "ref": {LOGPROBS: clean.logprobs}}


@pytest.mark.parametrize("continuations", [ONE, LONG, MIXED], ids=["one-token", "several", "mixed"])
def test_every_metric_matches_hf(pair_of_engines, continuations):
    hf, vl = pair_of_engines
    sources = _sources(hf, continuations)
    reqs = scored_requests(hf.shape, CORRUPT, continuations)
    a, b = hf.run(reqs, sources), vl.run(reqs, sources)
    assert_results_close(a, b)
    for x, y in zip(a, b):
        for field, value in dataclasses.asdict(Reading.of(x)).items():
            other = getattr(Reading.of(y), field)
            assert value == pytest.approx(other, abs=1e-4), field
    # the comparisons were of numbers that moved
    assert max(r.kl for r in b) - min(r.kl for r in b) > 1e-3
    assert len({tuple(r.answer_ranks) for r in b}) > 1


def lean(req: Request) -> Request:
    """`req` reading its answers' logits and nothing else (Request.reads_vocabulary false)."""
    return dataclasses.replace(req, continuations=(), reference=None, ranks=False, top_k=0, logprobs=False)


def test_a_run_reads_only_what_it_asks(pair_of_engines):
    """A run reading only its answers' logits (no ranks, KL or answers scored whole: the metric
    logit_diff alone) has the logits of the same run reading everything, on vLLM, where only those
    columns of the unembedding are computed (soft-capped as the family caps), and on hf; nothing
    else comes back. In one call with runs that read the whole vocabulary, each gets what it asked."""
    hf, vl = pair_of_engines
    sources = _sources(hf, ONE)
    full = scored_requests(hf.shape, CORRUPT, ONE)
    lean_reqs = [lean(r) for r in full]
    assert not any(r.reads_vocabulary for r in lean_reqs)
    want = vl.run(full, sources)
    for engine in (vl, hf):
        got = engine.run(lean_reqs, sources)
        for x, y in zip(got, want):
            assert (x.answer_logits - y.answer_logits).abs().max().item() <= (1e-6 if engine is vl else 1e-4)
            assert x.logsumexp is None and x.answer_ranks == [] and x.kl is None and x.continuation_logprobs == []
            reading = Reading.of(x)
            assert reading.logit_diff == pytest.approx(Reading.of(y).logit_diff, abs=1e-4)
            assert reading.kl is reading.rank is reading.p is reading.logprob_diff is None
    # ranks without KL, KL without ranks, each beside lean runs in one call
    asked = [lean_reqs[0], dataclasses.replace(lean_reqs[1], ranks=True),
             dataclasses.replace(lean_reqs[2], reference="ref"), full[3]]
    got = vl.run(asked, sources)
    assert got[0].logsumexp is None and got[0].answer_ranks == []
    assert got[1].answer_ranks == want[1].answer_ranks and got[1].kl is None
    assert got[2].answer_ranks == [] and got[2].kl == pytest.approx(want[2].kl, abs=1e-6)
    assert_results_close(got[3:], want[3:4], tol=1e-6)
    for x, y in zip(got, want):
        assert (x.answer_logits - y.answer_logits).abs().max().item() <= 1e-6


def test_scores_equal_a_plain_forward_over_prompt_and_answer(pair_of_engines):
    """What `continuation_logprobs`, `kl` and `answer_ranks` mean, checked without patchgrid's hooks:
    log-softmax of the model's logits over prompt + answer, read at the positions before each token."""
    hf, vl = pair_of_engines
    model = hf.model
    ref = hf.run([Request(tokens=CLEAN, logprobs=True)])[0].logprobs
    got = vl.run([Request(tokens=CORRUPT, answers=(5, 77), continuations=LONG, reference="ref")],
                 {"ref": {LOGPROBS: ref}})[0]
    n = len(CORRUPT)
    for c, scored in zip(LONG, got.continuation_logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([CORRUPT + c])).logits[0, :, : hf.shape.vocab_size].float()
        lp = torch.log_softmax(logits, -1)
        expected = [float(lp[n - 1 + k, t]) for k, t in enumerate(c)]
        assert scored == pytest.approx(expected, abs=1e-4)
        last = logits[n - 1]
        assert got.answer_ranks[0] == int((last > last[5]).sum())
        kl = float((ref.exp() * (ref - lp[n - 1])).sum())
        assert got.kl == pytest.approx(kl, abs=1e-4)


def test_a_continuation_never_shifts_what_a_patch_addresses(pair_of_engines):
    """The last prompt position's readings and the prompt's captures do not depend on whether (or
    which) answers are scored after it: patches address prompt positions."""
    _, vl = pair_of_engines
    sources = _sources(vl, LONG)
    n = len(CORRUPT)
    for positions in ((2,), (n - 1,), None):
        patch = (Patch("resid", 1, "clean", positions),)
        plain, scored = vl.run([Request(tokens=CORRUPT, answers=(5, 77), patches=patch, capture=("resid.2",)),
                                Request(tokens=CORRUPT, answers=(5, 77), continuations=LONG, patches=patch,
                                        capture=("resid.2",))], sources)
        assert torch.allclose(plain.answer_logits, scored.answer_logits, atol=1e-5)
        assert scored.captures["resid.2"].shape[0] == tree_len(Request(CORRUPT, continuations=LONG)) == n + 3
        assert torch.allclose(plain.captures["resid.2"], scored.captures["resid.2"][:n], atol=1e-5)


def test_started_runs_score_answers_like_full_ones(pair_of_engines):
    """A run started mid-stack reads its continuation positions' stream from the cached run too."""
    hf, vl = pair_of_engines
    sources = _sources(vl, LONG)
    stream = vl.run([Request(tokens=CORRUPT, answers=(5, 77), continuations=LONG,
                             capture=tuple(f"resid.{layer}" for layer in range(vl.shape.n_layers)))])[0]
    sources["corrupt"] = stream.captures
    reqs = [r for r in scored_requests(vl.shape, CORRUPT, LONG) if r.patches and r.patches[0].layer > 0]
    started = [dataclasses.replace(r, start=Start(r.patches[0].layer, "corrupt")) for r in reqs]
    assert_results_close(vl.run(started, sources), hf.run(reqs, sources))


def test_forwards_and_tree_rows():
    req = Request(tokens=(1, 2, 3), continuations=((4, 5, 6), (7,), (8, 9)))
    fwds = forwards(req)
    assert [f.tokens for f in fwds] == [(1, 2, 3, 4, 5), (1, 2, 3, 8)]
    assert [f.scores for f in fwds] == [(0, 1), (2,)]
    assert [f.branch for f in fwds] == [3, 5] and tree_len(req) == 6
    assert [f.first for f in fwds] == [True, False]
    assert forwards(Request(tokens=(1, 2), continuations=((4,), (7,))))[0].tokens == (1, 2)


def test_bad_continuations_are_refused(pair_of_engines):
    hf, vl = pair_of_engines
    too_long = (1,) * (hf.shape.max_len - len(CORRUPT) + 2)
    for bad, match in [(Request(tokens=CORRUPT, continuations=((),)), "continuation 0 is empty"),
                       (Request(tokens=CORRUPT, continuations=((5, hf.shape.vocab_size),)), "outside the vocabulary"),
                       (Request(tokens=CORRUPT, continuations=(too_long,)), "more than the model's"),
                       (Request(tokens=CORRUPT, reference="nothing"), "holds no logprobs")]:
        for engine in (hf, vl):
            with pytest.raises(PlanError, match=match):
                engine.run([bad])
