"""Edge attribution (patchgrid.methods.edge_attribution) against first-order computations written here from
the papers: an edge's score is the sender's clean - corrupt output times the gradient of the metric
at the receiver's own input, found here by finite differences of the metric with only that
receiver's input moved (the test builds each receiver's projection itself, per family)."""
from __future__ import annotations

import pytest

from patchgrid.methods.edge_attribution import EdgeScorer
from patchgrid.methods.graph import EdgeGraph
from tests.engine.methods.test_attribution import _metric, _pairs
from tests.support.engines import needs_vllm
from tests.unit.methods.test_attribution import _model64
from tests.unit.methods.test_edge_attribution import _capture, _moved, _sender_delta


def test_the_edges_sweep_stores_every_edge_of_every_pair_as_scored(tmp_path, engines, tokenizers):
    from patchgrid.cache import load_or_build
    from patchgrid.rows.effects import to_table
    from patchgrid.sweeps import SweepConfig, cache_spec, run_sweeps

    model = "tiny-llama"
    hf = engines.get(model, "hf", dtype="float32")
    pairs = _pairs(tokenizers, model)
    config = SweepConfig(sweeps=("edges",), edge_method="eap-ig", ig_steps=3)
    cache, _ = load_or_build(hf, pairs, cache_spec(config, hf.shape.n_layers), tmp_path, log=lambda *_: None)
    rows = run_sweeps(hf, pairs, cache, config, attributor={"device": "cpu", "dtype": "float32"})
    graph = EdgeGraph.of(hf.shape)
    assert len(rows) == len(pairs) * len(graph.edges)
    table = to_table(rows)  # the rows fit the effect shape
    assert table.num_rows == len(rows)
    from patchgrid.methods.attribution import attributor_for

    want = EdgeScorer(attributor_for(hf, device="cpu")).scores(pairs, "eap-ig", steps=3)
    for b, pair in enumerate(pairs):
        mine = {(r["sender"], r["receiver"]): r for r in rows if r["pair_id"] == pair.pair_id}
        assert set(mine) == {(graph.senders[i], graph.receivers[j]) for i, j in graph.edges}
        for (s, r), row in list(mine.items())[::17]:
            assert row["estimate"] == pytest.approx(float(want[b][graph.senders.index(s), graph.receivers.index(r)]),
                                                    rel=1e-6, abs=1e-9)
            assert row["metric"] == "logprob_diff" and row["sweep"] == "edges" and row["position"] is None
            assert row["site"] in ("resid_pre", "head", "mlp_out")
    each = run_sweeps(hf, pairs[:1], cache, SweepConfig(sweeps=("edges",), edge_method="eap", edge_positions="each"),
                      attributor={"device": "cpu", "dtype": "float32"})
    n = len(pairs[0].corrupt_ids)
    assert len(each) == n * len(graph.edges)
    summed = {}
    for r in each:
        summed[(r["sender"], r["receiver"])] = summed.get((r["sender"], r["receiver"]), 0.0) + r["estimate"]
    eap = EdgeScorer(attributor_for(hf, device="cpu")).scores(pairs[:1])[0]
    s, r = graph.senders[graph.edges[-1][0]], graph.receivers[graph.edges[-1][1]]
    assert summed[(s, r)] == pytest.approx(float(eap[graph.edges[-1]]), rel=1e-4, abs=1e-6)


@needs_vllm
def test_the_strongest_edges_and_a_sample_are_patched_exactly_on_vllm(tmp_path, engines, tokenizers):
    """Each verified edge's exact effect on vLLM equals the edge intervention done here on transformers:
    the corrupt run with only the receiver's input moved by the sender's clean - corrupt output."""
    from patchgrid.cache import load_or_build
    from patchgrid.sweeps import SweepConfig, cache_spec, count_runs, run_sweeps

    model = "tiny-llama"
    vl = engines.get(model, "vllm", dtype="float32")
    pairs = _pairs(tokenizers, model)[1:]
    config = SweepConfig(sweeps=("edges",), edge_method="eap", verify_top=6, verify_random=6, seed=1)
    cache, _ = load_or_build(vl, pairs, cache_spec(config, vl.shape.n_layers), tmp_path, log=lambda *_: None)
    rows = run_sweeps(vl, pairs, cache, config, attributor={"device": "cpu", "dtype": "float32"})
    verified = [r for r in rows if r.get("verify") is not None]
    assert len(verified) == count_runs(pairs, config, vl.shape.n_layers, vl.shape.n_heads, vl.shape.d_mlp,
                                       vl.shape.kv_heads) == 12 * len(pairs)
    m, shape = _model64(model)
    kinds = set()
    for pair in pairs:
        mine = [r for r in rows if r["pair_id"] == pair.pair_id]
        top = [r for r in mine if r.get("verify") == "top"]
        assert len(top) == 6 and min(abs(r["estimate"]) for r in top) >= max(
            abs(r["estimate"]) for r in mine if r.get("verify") != "top")
        clean, corrupt = _capture(m, shape, pair.clean_ids), _capture(m, shape, pair.corrupt_ids)
        base = _metric(m, pair)
        for r in mine:
            if r.get("verify") is None:
                assert r.get("effect") is None and r.get("patched_logprob_diff") is None
                continue
            hooks = _moved(m, shape, r["receiver"], _sender_delta(m, shape, clean, corrupt, r["sender"]))
            try:
                want = _metric(m, pair) - base
            finally:
                for h in hooks:
                    h.remove()
            assert r["effect"] == pytest.approx(want, abs=2e-4), (pair.pair_id, r["sender"], r["receiver"])
            kinds.add(r["receiver"].split(".")[0])
    assert kinds >= {"logits", "mlp_in"}, kinds  # both new ends of a path were patched
    # the sample is seeded: the same again
    again = run_sweeps(vl, pairs, cache, config, attributor={"device": "cpu", "dtype": "float32"})
    assert [(r["sender"], r["receiver"], r.get("verify")) for r in again] == [
        (r["sender"], r["receiver"], r.get("verify")) for r in rows]

