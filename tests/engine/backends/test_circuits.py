"""Circuit runs (plan.Circuit, backends.edge_ablation): vLLM against the hf backend, the two ends
of the curve (every edge kept is the clean run, none kept the source run), and one ablated edge
against the edge intervention written in tests/engine/methods/test_edge_attribution.py from the weights."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from patchgrid.methods.graph import EdgeGraph, circuit_keys
from patchgrid.plan import Circuit, Request
from tests.engine.methods.test_attribution import _metric
from tests.support.engines import TINY, needs_vllm
from tests.support.pairs import shipped_pairs
from tests.unit.methods.test_attribution import _model64
from tests.unit.methods.test_edge_attribution import _capture, _moved, _sender_delta


def _runs(engine, pairs, kept_sets):
    """Per pair: the clean run, the corrupt run, and the clean prompt's circuit run for each kept set
    (the source: the corrupt run's senders), all in one call."""
    keys = tuple(circuit_keys(engine.shape.n_layers))
    base = engine.run([Request(ids, p.answers, continuations=p.continuations, capture=keys)
                       for p in pairs for ids in (p.clean_ids, p.corrupt_ids)])
    sources = {f"corrupt{i}": base[2 * i + 1].captures for i in range(len(pairs))}
    reqs = [Request(p.clean_ids, p.answers, continuations=p.continuations, circuit=Circuit(f"corrupt{i}", kept))
            for i, p in enumerate(pairs) for kept in kept_sets]
    out = engine.run(reqs, sources)
    k = len(kept_sets)
    return [(base[2 * i], base[2 * i + 1], out[i * k:(i + 1) * k]) for i in range(len(pairs))]


@needs_vllm
@pytest.mark.parametrize("model", TINY)
def test_a_circuit_run_on_vllm_equals_hf_and_its_ends_are_the_clean_and_corrupt_runs(engines, tokenizers, model):
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32")
    pairs = shipped_pairs(tokenizers(model), 3)
    # answers of several tokens, scored whole: a forward per answer, past the prompt reading the
    # source's rows along the same continuation
    a, b = pairs[0].clean_answer_id, pairs[0].corrupt_answer_id
    pairs[0] = replace(pairs[0], clean_answer_ids=(a, 11, 12), corrupt_answer_ids=(b, 13))
    n = len(EdgeGraph.of(hf.shape).edges)
    rng = random.Random(0)
    kept_sets = [tuple(range(n)), ()] + [tuple(sorted(rng.sample(range(n), int(n * f)))) for f in (0.02, 0.3, 0.9)]
    got = {name: _runs(e, pairs, kept_sets) for name, e in (("hf", hf), ("vllm", vl))}
    for name in got:
        for clean, corrupt, runs in got[name]:
            # every edge kept: no receiver reads anything but its stream, so the clean run: exactly on vLLM,
            # whose products take a row alike in any batch; on hf to float32 rounding, since its forward's
            # products round with its batch (on an AMD EPYC with AVX-512, a product of 2 or 3 rows otherwise
            # than of 4 or more)
            if name == "vllm":
                assert torch.equal(runs[0].answer_logits, clean.answer_logits), name
                assert runs[0].continuation_logprobs == clean.continuation_logprobs
            else:
                torch.testing.assert_close(runs[0].answer_logits, clean.answer_logits, atol=1e-5, rtol=0)
                torch.testing.assert_close(torch.tensor(sum(runs[0].continuation_logprobs, [])),
                                           torch.tensor(sum(clean.continuation_logprobs, [])), atol=1e-5, rtol=0)
            # none kept: every receiver reads the corrupt run's stream, so the corrupt run (to rounding)
            torch.testing.assert_close(runs[1].answer_logits, corrupt.answer_logits, atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(sum(runs[1].continuation_logprobs, [])),
                                       torch.tensor(sum(corrupt.continuation_logprobs, [])), atol=1e-5, rtol=0)
            # a circuit in between moves the answer: the test would see a circuit run that did nothing
            assert not torch.equal(runs[3].answer_logits, clean.answer_logits)
    for (_, _, h), (_, _, v) in zip(got["hf"], got["vllm"]):
        for x, y in zip(h, v):
            torch.testing.assert_close(y.answer_logits, x.answer_logits, atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(sum(y.continuation_logprobs, [])),
                                       torch.tensor(sum(x.continuation_logprobs, [])), atol=1e-4, rtol=0)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_one_ablated_edge_is_the_receivers_input_moved_by_the_senders_difference(engines, tokenizers, model):
    """Every edge kept but sender -> receiver, on the corrupt prompt with the clean run as source:
    the receiver alone reads its stream plus the sender's clean - corrupt output (the intervention
    tests/engine/methods/test_edge_attribution.py builds from the weights, here on a float64 model)."""
    hf = engines.get(model, "hf", dtype="float32")
    pair = shipped_pairs(tokenizers(model), 2)[1]
    graph = EdgeGraph.of(hf.shape)
    keys = tuple(circuit_keys(hf.shape.n_layers))
    answers = (pair.clean_answer_id, pair.corrupt_answer_id)
    clean = hf.run([Request(pair.clean_ids, answers, capture=keys)])[0]
    m, shape = _model64(model)
    c64, k64 = _capture(m, shape, pair.clean_ids), _capture(m, shape, pair.corrupt_ids)
    L = graph.n_layers
    for sender, receiver in [("input", "q.1.2"), ("head.0.3", "k.1.1"), ("mlp_out.0", "v.1.0"),
                             ("head.1.1", "mlp_in.1"), ("head.0.2", "logits"), (f"mlp_out.{L - 1}", "logits")]:
        s, r = graph.senders.index(sender), graph.receivers.index(receiver)
        edge = graph.edges.index((s, r))
        kept = tuple(i for i in range(len(graph.edges)) if i != edge)
        res = hf.run([Request(pair.corrupt_ids, answers, circuit=Circuit("clean", kept))], {"clean": clean.captures})[0]
        got = float(res.answer_logits[0] - res.answer_logits[1])
        hooks = _moved(m, shape, receiver, _sender_delta(m, shape, c64, k64, sender))
        try:
            want = _metric(m, pair)
        finally:
            for h in hooks:
                h.remove()
        assert got == pytest.approx(want, abs=1e-4), (sender, receiver)


@needs_vllm
def test_calls_of_circuit_runs_are_cut_to_bound_their_deltas_and_give_the_same_numbers(engines, tokenizers,
                                                                                      monkeypatch):
    from patchgrid.backends import edge_ablation

    model = "tiny-llama"
    pairs = shipped_pairs(tokenizers(model), 2)
    n = len(EdgeGraph.of(engines.get(model, "hf", dtype="float32").shape).edges)
    kept_sets = [(), tuple(range(0, n, 3))]
    for name, method in (("hf", "_forward"), ("vllm", "_generate")):
        e = engines.get(model, name, dtype="float32")
        calls = []  # per engine call (hf: batch), how many circuit runs it held
        inner = getattr(e, method)

        def counted(reqs, *a, inner=inner, calls=calls, **k):
            calls.append(sum((r[0] if isinstance(r, tuple) else r).circuit is not None for r in reqs))
            return inner(reqs, *a, **k)

        monkeypatch.setattr(e, method, counted)
        whole = _runs(e, pairs, kept_sets)
        assert max(calls) > 1, name  # several circuit runs share a call
        calls.clear()
        monkeypatch.setattr(edge_ablation, "CIRCUIT_DELTA_BYTES", 1)  # every circuit run a call of its own
        cut = _runs(e, pairs, kept_sets)
        monkeypatch.undo()
        assert sorted(c for c in calls if c) == [1] * len(pairs) * len(kept_sets), name
        for (_, _, a), (_, _, b) in zip(whole, cut):
            for x, y in zip(a, b):
                torch.testing.assert_close(y.answer_logits, x.answer_logits, atol=1e-6, rtol=0)
    assert edge_ablation.cut_by_deltas([1, 2, 3, 4], lambda x: x, budget=5) == [[1, 2], [3], [4]]

