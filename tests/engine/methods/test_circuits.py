"""Circuits from edge scores (patchgrid.methods.circuits) against MIB's construction written here from its
description, the circuit sweep end to end on vLLM (its circuits, the ends of its curve, a circuit's
reading against a circuit run on the hf backend), what the ablations write (zero: zeros; mean: the
cache's mean at each position role, computed here), and the refusals."""
from __future__ import annotations

import pytest
import torch

from patchgrid.methods.circuits import circuit_size
from patchgrid.methods.graph import EdgeGraph, circuit_keys
from patchgrid.plan import Circuit, Request
from patchgrid.sweeps import SweepConfig
from tests.support.engines import needs_vllm
from tests.support.pairs import shipped_pairs


@needs_vllm
def test_the_circuit_sweep_on_vllm(engines, tokenizers):
    import tempfile
    from pathlib import Path

    from patchgrid.cache import load_or_build
    from patchgrid.sweeps import cache_spec, run_sweeps

    model = "tiny-llama"
    vl = engines.get(model, "vllm", dtype="float32")
    hf = engines.get(model, "hf", dtype="float32")
    pairs = shipped_pairs(tokenizers(model), 3)
    config = SweepConfig(sweeps=("edges", "circuit"), edge_method="eap", verify_top=0, verify_random=0,
                         circuit_sizes=(2, 20, 100))
    cache, _ = load_or_build(vl, pairs, cache_spec(config, vl.shape.n_layers), Path(tempfile.mkdtemp()),
                             log=lambda *_: None)
    rows = run_sweeps(vl, pairs, cache, config, attributor={"device": "cpu", "dtype": "float32"})
    graph = EdgeGraph.of(vl.shape)
    n = len(graph.edges)
    edges = [r for r in rows if r["sweep"] == "edges"]
    circuit = [r for r in rows if r["sweep"] == "circuit"]
    assert len(circuit) == 4 * len(pairs) and len(edges) == n * len(pairs)
    # the order: by |mean score over pairs|, written here from the edge rows
    mean = {}
    for r in edges:
        mean.setdefault((r["sender"], r["receiver"]), []).append(r["estimate"])
    ranked = sorted(mean, key=lambda e: -abs(sum(mean[e]) / len(pairs)))
    rank = {(r["sender"], r["receiver"]): r["circuit_rank"] for r in edges}
    assert [e for e in sorted(rank, key=rank.get)][:20] == ranked[:20]
    index = {(graph.senders[i], graph.receivers[j]): e for e, (i, j) in enumerate(graph.edges)}
    keys = tuple(circuit_keys(vl.shape.n_layers))
    for p in pairs:
        mine = {r["circuit_size"]: r for r in circuit if r["pair_id"] == p.pair_id}
        assert mine[0]["recovery"] == 0 and mine[0]["effect"] == 0 and mine[100]["recovery"] == 1
        assert mine[100]["patched_logprob_diff"] == mine[100]["clean_logprob_diff"]
        assert mine[20]["circuit_edges"] == circuit_size(20, n)
        # the 20% circuit's run, on the hf backend, from the edges the order says
        kept = tuple(sorted(index[e] for e in sorted(rank, key=rank.get)[:circuit_size(20, n)]))
        corrupt = hf.run([Request(p.corrupt_ids, p.answers, capture=keys)])[0]
        got = hf.run([Request(p.clean_ids, p.answers, circuit=Circuit("c", kept))], {"c": corrupt.captures})[0]
        assert mine[20]["patched_logprob_diff"] == pytest.approx(
            float(got.answer_logits[0] - got.answer_logits[1]), abs=1e-4)


@needs_vllm
@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_a_site_sweep_patches_the_ablation_it_is_given(engines, tokenizers, tmp_path, ablation):
    """resid at one layer and position, denoising with zeros or the clean runs' mean at the role: the
    patched run equals the corrupt run with that value written there on the hf backend."""
    from patchgrid.cache import load_or_build
    from patchgrid.plan import Patch
    from patchgrid.sweeps import cache_spec, run_sweeps

    model = "tiny-llama"
    vl = engines.get(model, "vllm", dtype="float32")
    hf = engines.get(model, "hf", dtype="float32")
    pairs = shipped_pairs(tokenizers(model), 3)
    config = SweepConfig(sweeps=("resid",), resid_directions=("denoise",), layers=(1,), positions=(0, 2),
                         ablation=ablation)
    cache, _ = load_or_build(vl, pairs, cache_spec(config, vl.shape.n_layers), tmp_path, log=lambda *_: None)
    rows = run_sweeps(vl, pairs, cache, config)
    assert rows and {r["ablation"] for r in rows} == {ablation}
    clean = {p.pair_id: hf.run([Request(p.clean_ids, p.answers, capture=("resid.1",))])[0].captures["resid.1"]
             for p in pairs}
    for p in pairs:
        for r in (r for r in rows if r["pair_id"] == p.pair_id):
            pos = r["position"]
            if ablation == "zero":
                value = torch.zeros(len(p.clean_ids), vl.shape.d_model)
            else:  # the mean over the pairs' clean runs at each position's role, computed here
                role = p.roles[pos]
                at = [clean[q.pair_id][k] for q in pairs for k, x in enumerate(q.roles[:len(q.clean_ids)]) if x == role]
                value = torch.stack(at).mean(0).expand(len(p.clean_ids), -1)
            got = hf.run([Request(p.corrupt_ids, p.answers, patches=(Patch("resid", 1, "v", (pos,)),))],
                         {"v": {"resid.1": value}})[0]
            assert r["patched_logit_diff"] == pytest.approx(float(got.answer_logits[0] - got.answer_logits[1]),
                                                            abs=1e-4), (p.pair_id, pos)

