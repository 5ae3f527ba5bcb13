"""Circuits from edge scores (patchgrid.methods.circuits) against MIB's construction written here from its
description, the circuit sweep end to end on vLLM (its circuits, the ends of its curve, a circuit's
reading against a circuit run on the hf backend), what the ablations write (zero: zeros; mean: the
cache's mean at each position role, computed here), and the refusals."""
from __future__ import annotations

import random

import pytest
import torch

from patchgrid.methods.circuits import circuit_size, edge_order
from patchgrid.methods.graph import EdgeGraph
from patchgrid.model.sites import FAMILIES
from patchgrid.settings import SpecError
from patchgrid.sweeps import SweepConfig
from patchgrid.sweeps.ablated import AblatedSources
from patchgrid.sweeps.run import check_family


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

