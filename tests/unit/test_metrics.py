"""patchgrid.metrics against values worked out by hand: recovery, KL, ranks, and a run's Reading."""
from __future__ import annotations

import math
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from patchgrid.metrics import (
    METRICS,
    KlReference,
    Reading,
    answer_ranks,
    kl_divergence,
    logsumexp_rows,
    reads_of,
    recovery,
)


@pytest.mark.parametrize("patched, clean, corrupt, want", [
    (1.0, 3.0, -1.0, 0.5),  # (1 - -1) / (3 - -1)
    (3.0, 3.0, -1.0, 1.0),  # the clean value restored
    (-1.0, 3.0, -1.0, 0.0),  # nothing moved
    (5.0, 3.0, -1.0, 1.5),  # past the clean value
    (-3.0, 3.0, -1.0, -0.5),  # the wrong way
    (0.5, 0.0, 2.0, 0.75),  # a metric where smaller is better (kl): (0.5 - 2) / (0 - 2)
])
def test_recovery_is_the_fraction_of_the_span_restored(patched, clean, corrupt, want):
    assert recovery(patched, clean, corrupt) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("args", [(1.0, 2.0, 2.0), (None, 1.0, 0.0), (1.0, None, 0.0), (1.0, 1.0, None)])
def test_recovery_is_undefined_without_a_span(args):
    assert recovery(*args) is None


def test_kl_divergence_of_two_coins():
    reference = torch.tensor([0.5, 0.5]).log()
    run = torch.tensor([0.25, 0.75]).log()
    # 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75) = 0.5 ln(4 / 3)
    assert kl_divergence(reference, run).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    # KL is not symmetric: 0.25 ln(0.25 / 0.5) + 0.75 ln(0.75 / 0.5) = 0.75 ln 3 - ln 2
    assert kl_divergence(run, reference).item() == pytest.approx(0.75 * math.log(3) - math.log(2), rel=1e-6)
    assert kl_divergence(reference, reference).item() == 0.0


def test_the_kl_of_many_rows_from_one_reference_is_the_definition_rearranged():
    g = torch.Generator().manual_seed(0)
    reference = torch.log_softmax(3 * torch.randn(5000, generator=g), 0)
    logits = 4 * torch.randn(6, 5000, generator=g)
    logits[0] = reference + 7.5  # the reference itself, shifted: KL 0
    lse = torch.logsumexp(logits, 1)
    got = KlReference(reference).kl(logits, lse)
    want = kl_divergence(reference.expand(6, -1), logits - lse[:, None])
    assert got.dtype == torch.float32 and got.shape == (6,)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert abs(got[0].item()) < 1e-6 and (got[1:] > 0.5).all()
    # a row equal to the reference reads exactly 0, whatever the order of its sum (a Ray worker's)
    assert KlReference(reference).kl(reference[None], torch.zeros(1)).item() == 0.0


def test_kl_divergence_is_per_row_in_float32():
    reference = torch.tensor([[0.5, 0.5], [0.9, 0.1]], dtype=torch.bfloat16).log()
    out = kl_divergence(reference, reference)
    assert out.dtype == torch.float32 and out.shape == (2,)
    assert out.tolist() == [0.0, 0.0]


def test_answer_ranks_count_the_strictly_larger_logits():
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0])
    # token 1 (3.0): none larger (the tie with token 3 does not count); token 2 (2.0): two 3.0s; token 0: three
    assert answer_ranks(logits, [1, 2, 0]).tolist() == [0, 2, 3]
    batch = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    assert answer_ranks(batch, [[0, 2], [0, 2]]).tolist() == [[2, 0], [0, 2]]


def _result(answer_logits, clean, corrupt, kl=None, ranks=(0, 1)):
    return SimpleNamespace(answer_logits=torch.tensor(answer_logits), continuation_logprobs=(clean, corrupt), kl=kl,
                           answer_ranks=list(ranks))


def test_the_readouts_reductions_taken_a_few_rows_at_a_time_are_each_rows_own(monkeypatch):
    """logsumexp_rows, KlReference.kl and answer_ranks work through a step's rows in chunks
    (row_chunks); each row's number is what that row alone gives by the definition: torch's
    logsumexp of it beside other rows, kl_divergence, a count of the larger logits. A row read alone
    gets the logsumexp it gets among others (torch reduces a lone row otherwise)."""
    import patchgrid.metrics as metrics

    monkeypatch.setattr(metrics, "CPU_CHUNK_BYTES", 3 * 8 * 50000)  # three rows a chunk
    assert [(s.start, s.stop) for s in metrics.row_chunks(torch.zeros(7, 50000))] == [(0, 3), (3, 7)]
    assert [(s.start, s.stop) for s in metrics.row_chunks(torch.zeros(1, 50000))] == [(0, 1)]
    g = torch.Generator().manual_seed(2)
    logits = 5 * torch.randn(64, 50000, generator=g)  # wide enough for torch to split a lone row
    reference = torch.log_softmax(logits[3].double(), 0).float()
    lse = logsumexp_rows(logits)
    assert torch.equal(lse, torch.logsumexp(logits, 1))
    assert all(torch.equal(logsumexp_rows(logits[i:i + 1]), lse[i:i + 1]) for i in range(64))  # 1 differs alone
    kl = KlReference(reference).kl(logits, lse)
    assert torch.equal(kl, torch.stack([KlReference(reference).kl(logits[i:i + 2], lse[i:i + 2])[0]
                                        for i in range(64)]))
    torch.testing.assert_close(kl, kl_divergence(reference.expand(64, -1), logits - lse[:, None]),
                               rtol=1e-6, atol=1e-6)
    tokens = torch.randint(0, 50000, (64, 2), generator=g)
    want = [[int((logits[i] > logits[i, t]).sum()) for t in tokens[i].tolist()] for i in range(64)]
    assert answer_ranks(logits, tokens).tolist() == want
    # some rows read where they lie (the readout's firsts among a step's rows), a chunk at a time
    rows = torch.tensor([1, 4, 5, 9, 30, 63])
    assert torch.equal(KlReference(reference).kl(logits, lse, rows), kl[rows])
    assert answer_ranks(logits, tokens[rows], rows).tolist() == [want[i] for i in rows.tolist()]
    assert KlReference(reference).kl(logits, lse, rows[:0]).shape == (0,)


def test_a_reading_of_one_token_answers():
    r = Reading.of(_result([2.5, 0.5], [-0.5], [-2.0], kl=0.25, ranks=(3, 0)))
    assert r == Reading(logit_diff=2.0, logprob_diff=1.5, logp_clean=-0.5, logp_corrupt=-2.0, p=math.exp(-0.5),
                        kl=0.25, rank=3.0, logp_clean_tokens=(-0.5,), logp_corrupt_tokens=(-2.0,))
    assert all(isinstance(getattr(r, f), float) for f in ("logit_diff", "rank"))


def test_a_reading_of_longer_answers_sums_their_tokens_and_has_no_logit_diff():
    r = Reading.of(_result([2.5, 0.5], [-0.5, -0.25], [-1.0], kl=None), kl=0.125)
    assert r.logit_diff is None
    assert r.logp_clean == -0.75 and r.logp_corrupt == -1.0
    assert r.logprob_diff == pytest.approx(0.25)
    assert r.p == pytest.approx(math.exp(-0.75))
    assert r.kl == 0.125  # the result had none: the one given
    assert r.logp_clean_tokens == (-0.5, -0.25)
    assert Reading.of(_result([1.0, 0.0], [-0.5], [-1.0], kl=None)).kl is None


def test_a_reading_of_a_run_that_read_only_some_metrics_has_none_for_the_rest():
    # the answers' logits alone (logit_diff): no answer scored whole, no rank, no KL
    r = Reading.of(SimpleNamespace(answer_logits=torch.tensor([2.5, 0.5]), continuation_logprobs=[], kl=None,
                                   answer_ranks=[]))
    assert r == Reading(2.0, None, None, None, None, None, None)
    assert Reading.of(_result([2.5, 0.5], [-0.5], [-2.0], ranks=())).rank is None
    assert reads_of(["logit_diff"]) == {"answers"}
    assert reads_of(METRICS) == {"answers", "continuations", "reference", "ranks"}
    full = Reading(1.0, 2.0, -1.0, -3.0, 0.5, 0.1, 2.0, (-1.0,), (-3.0,))
    assert full.only(METRICS) == full
    assert full.only(["logit_diff", "logp_clean"]) == Reading(1.0, None, -1.0, None, None, None, None, (-1.0,), ())


def test_the_mean_of_readings_is_field_by_field_and_token_by_token():
    a = Reading(1.0, 2.0, -1.0, -3.0, 0.5, 0.0, 0.0, (-0.5, -0.5), (-3.0,))
    b = Reading(3.0, 4.0, -2.0, -1.0, 0.25, None, 4.0, (-1.5, -0.5), (-1.0,))
    m = Reading.mean([a, b])
    assert m == Reading(2.0, 3.0, -1.5, -2.0, 0.375, None, 2.0, (-1.0, -0.5), (-2.0,))
    assert Reading.mean([a]) == a


def test_every_metric_is_a_field_of_a_reading_with_a_direction():
    names = {f.name for f in fields(Reading)}
    assert set(METRICS) <= names
    for name, metric in METRICS.items():
        assert metric.better in (+1, -1), name
    # smaller is better exactly where the clean run's value is the smaller one
    assert {n for n, m in METRICS.items() if m.better == -1} == {"logp_corrupt", "kl", "rank"}
    assert METRICS["rank"].min_span is None  # a ratio of ranks means nothing
    reading = Reading(1.0, 2.0, -1.0, -3.0, 0.5, 0.1, 2.0)
    assert [reading.value(n) for n in ("logit_diff", "kl", "rank")] == [1.0, 0.1, 2.0]
