"""Circuits from edge scores (patchgrid.methods.circuits) against MIB's construction written here from its
description, the circuit sweep end to end on vLLM (its circuits, the ends of its curve, a circuit's
reading against a circuit run on the hf backend), what the ablations write (zero: zeros; mean: the
cache's mean at each position role, computed here), and the refusals."""
from __future__ import annotations

import random

import pytest
import torch

from patchgrid.methods.circuits import circuit_size, edge_order
from patchgrid.methods.graph import EdgeGraph, circuit_keys
from patchgrid.model.sites import FAMILIES
from patchgrid.plan import Circuit, Request
from patchgrid.settings import SpecError
from patchgrid.sweeps import SweepConfig
from patchgrid.sweeps.ablated import AblatedSources
from patchgrid.sweeps.run import check_family
from tests.support.engines import needs_vllm
from tests.support.pairs import shipped_pairs


def _mib_greedy(graph: EdgeGraph, scores: list[float]) -> list[int]:
    """MIB's apply_greedy, as its description says: the circuit starts at the logits; the edge of
    largest |score| among those into a node of the circuit is added next, and its sender joins the
    circuit (a head's inputs are its q and its key/value head's k and v). Quadratic, plainly."""
    group = graph.n_heads // graph.n_kv_heads

    def node(receiver):
        if receiver == "logits":
            return {"logits"}
        what, layer, *unit = receiver.split(".")
        if what == "mlp_in":
            return {f"mlp_out.{layer}"}
        u = int(unit[0])
        if what == "q":
            return {f"head.{layer}.{u}"}
        return {f"head.{layer}.{h}" for h in range(u * group, (u + 1) * group)}

    nodes, taken, order = {"logits"}, set(), []
    while len(order) < len(graph.edges):
        best = None
        for e, (_, j) in enumerate(graph.edges):
            if e not in taken and node(graph.receivers[j]) & nodes:
                if best is None or abs(scores[e]) > abs(scores[best]):
                    best = e
        order.append(best)
        taken.add(best)
        nodes.add(graph.senders[graph.edges[best][0]])
    return order


@pytest.mark.parametrize("kv", [4, 2])
def test_greedy_is_mibs_and_topn_ranks_by_magnitude(kv):
    graph = EdgeGraph(3, 4, kv, False)
    rng = random.Random(kv)
    scores = torch.tensor([rng.gauss(0, 1) for _ in graph.edges], dtype=torch.float64)
    assert edge_order(graph, scores, "greedy") == _mib_greedy(graph, scores.tolist())
    top = edge_order(graph, scores, "topn")
    assert sorted(top) == list(range(len(graph.edges)))
    assert [abs(scores[e]) for e in top] == sorted(abs(scores).tolist(), reverse=True)
    assert circuit_size(0.1, 70651) == 70 and circuit_size(100, 70651) == 70651  # MIB's count


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


class _Store:
    """Captures made here: per pair, a run's values [positions, width] at a key."""

    def __init__(self, caps):
        self.caps = caps

    def captures(self, pair_id, run):
        return dict(self.caps[(pair_id, run)])


def test_the_ablations_write_zeros_and_the_mean_at_each_position_role():
    from patchgrid.model.sites import ModelShape
    from tests.support.effect_rows import make_pair

    shape = ModelShape(FAMILIES["llama"], 2, 2, 4, 8, 50, 32, 16, 1)
    from dataclasses import replace

    # b's clean answer has two tokens: its runs hold one row past the prompt (the answer's input)
    pairs = [make_pair("a", ["subject_first", "subject_last", "last"]),
             replace(make_pair("b", ["subject_first", "further", "further", "last"]), clean_answer_ids=(1, 3))]
    gen = torch.Generator().manual_seed(0)
    rows = {"a": 3, "b": 5}
    caps = {(p.pair_id, "clean"): {"resid.0": torch.randn(rows[p.pair_id], 8, generator=gen),
                                   "head.1": torch.randn(rows[p.pair_id], 8, generator=gen)} for p in pairs}
    src = AblatedSources(shape, pairs, _Store(caps))
    assert src.get("1:clean", {"resid.0"}) is None  # the run's own values: not an ablation
    zero = src.get("1:~zero", {"resid.0", "head.1"})
    assert all(torch.equal(t, torch.zeros(5, 8)) for t in zero.values())  # the prompt and the answer's input
    mean = src.get("1:clean~mean", {"resid.0"})["resid.0"]
    a, b = caps[("a", "clean")]["resid.0"], caps[("b", "clean")]["resid.0"]
    want = {"subject_first": (a[0] + b[0]) / 2, "further": (b[1] + b[2]) / 2, "last": (a[2] + b[3]) / 2,
            "continuation": b[4]}
    for pos, role in enumerate(list(pairs[1].roles) + ["continuation"]):
        torch.testing.assert_close(mean[pos], want[role])
    assert len(src.get("0:clean~mean", {"head.1"})["head.1"]) == 3


@pytest.mark.parametrize("settings, flag, message", [
    (dict(sweeps="edges,circuit", circuit_sizes="0,10"), "--circuit-sizes", "0: a percentage must be in (0, 100]"),
    (dict(sweeps="edges,circuit", circuit_sizes="150"), "--circuit-sizes", "150: a percentage must be in (0, 100]"),
    (dict(sweeps="circuit"), "--sweeps", "circuit builds its circuits from the run's edge scores: add edges"),
    (dict(sweeps="circuit,edges"), "--sweeps", "edges must come before circuit"),
    (dict(sweeps="trace", ablation="mean"), "--ablation", "none of the sweeps trace takes it"),
])
def test_circuit_settings_that_cannot_run_are_refused_in_one_line(settings, flag, message):
    from patchgrid.pipeline.spec import check_sweep_settings_apply

    with pytest.raises(SpecError) as err:
        check_sweep_settings_apply(SweepConfig(**settings))
    assert flag in err.value.flag_message and message in err.value.flag_message
    assert "\n" not in err.value.flag_message


def test_a_family_whose_nodes_cannot_be_split_or_whose_block_is_parallel_is_refused():
    config = SweepConfig(sweeps=("edges", "circuit"))
    with pytest.raises(ValueError, match="sweep circuit: the gptj block is parallel"):
        check_family(config, FAMILIES["gptj"])  # edges score a parallel block; circuit runs are not built for it
    with pytest.raises(ValueError, match="normalises attention's summed output"):
        check_family(config, FAMILIES["olmo2"])


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
