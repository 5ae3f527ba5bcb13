"""Circuits in the warehouse: the circuit sweep's rows (CircuitSweep.rows, on readings made here) and
the edges sweep's ranks loaded; circuit_curve against MIB's faithfulness of means and a t interval
by hand (scipy's quantile), circuit_score against MIB's trapezoids written here from its
`evaluate_area_under_curve`, circuit_edges against the order; the rows stay out of the effect views."""
from __future__ import annotations

import statistics

import pytest
from scipy import stats

from patchgrid.methods.circuits import circuit_size, edge_order
from patchgrid.methods.graph import EdgeGraph
from patchgrid.sweeps import SweepConfig
from patchgrid.sweeps.base import SweepContext, baselines
from patchgrid.sweeps.circuit import CircuitSweep
from patchgrid.sweeps.edges import EdgeSweep
from tests.support.effect_rows import baseline, between
from tests.unit.warehouse.test_edge_views import SHAPE, random_edge_scores
from tests.unit.warehouse.test_path_views import N_PAIRS, _rows, load

SIZES = (10.0, 20.0, 50.0, 100.0)


def circuit_rows(ablation="patching"):
    graph, pairs, scored = random_edge_scores(7)
    edges, index, scores = graph.edges, scored["index"], scored["scores"]
    config = SweepConfig(sweeps=("edges", "circuit"), verify_top=0, verify_random=0, circuit_sizes=SIZES,
                         ablation=ablation)
    mean = sum(scores[p.pair_id][index] for p in pairs) / len(pairs)
    order = edge_order(graph, mean.double(), "topn")
    rank = [0] * len(edges)
    for k, e in enumerate(order):
        rank[e] = k
    sizes = (0.0,) + SIZES
    circuits = {s: tuple(sorted(order[:circuit_size(s, len(edges))])) for s in sizes}
    prepared = {"edges": scored,
                "circuit": {"rank": rank, "circuits": circuits,
                            "baselines": {p.pair_id: baselines(baseline(p.pair_id)) for p in pairs}}}
    ctx = SweepContext(config, SHAPE.n_layers, SHAPE.n_heads, prepared=prepared)
    rows, recoveries = [], {}
    for k, p in enumerate(pairs):
        rows += EdgeSweep({}).rows(p, [], baseline(p.pair_id), ctx)
        # the circuit at size s recovers s / 100 of the way plus a pair's own wobble; the empty one 0
        got = [(CircuitSweep().cell_of_size(s), between(0.0 if s == 0 else s / 100 + 0.03 * (k - 2))) for s in sizes]
        recoveries[p.pair_id] = {s: r.value("logprob_diff") for s, r in got}
        rows += CircuitSweep().rows(p, got, baseline(p.pair_id), ctx)
    return rows, order, recoveries


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    rows, order, values = circuit_rows()
    wh, stored = load(tmp_path_factory.mktemp("circuits"), rows,
                      params={"edge_method": "eap", "circuit_build": "topn"})
    return wh, stored, order, values


def test_the_curve_is_mibs_faithfulness_of_means_beside_the_mean_of_pairs_faithfulness(study):
    wh, stored, _, _ = study
    rows = [r for r in stored if r["sweep"] == "circuit"]
    curve = {r["size"]: r for r in _rows(wh, "SELECT * FROM circuit_curve WHERE run_id = 'r'")}
    assert sorted(curve) == [0.0, *SIZES]
    for size, c in curve.items():
        mine = [r for r in rows if r["circuit_size"] == size]
        empty = {r["pair_id"]: r["patched_logprob_diff"] for r in rows if r["circuit_size"] == 0}
        value = statistics.mean(r["patched_logprob_diff"] for r in mine)
        e = statistics.mean(empty.values())
        full = statistics.mean(r["clean_logprob_diff"] for r in mine)
        assert c["faithfulness"] == pytest.approx((value - e) / (full - e), abs=1e-9)
        per = [(r["patched_logprob_diff"] - empty[r["pair_id"]]) / (r["clean_logprob_diff"] - empty[r["pair_id"]])
               for r in mine]
        half = stats.t.ppf(0.975, len(per) - 1) * statistics.stdev(per) / len(per) ** 0.5
        assert c["mean_pair_faithfulness"] == pytest.approx(statistics.mean(per), abs=1e-9)
        assert c["pair_faithfulness_ci95_low"] == pytest.approx(statistics.mean(per) - half, abs=1e-4)
        assert c["n_pairs"] == N_PAIRS and c["share"] == size / 100
        assert (c["method"], c["build"], c["ablation"], c["metric"]) == ("eap", "topn", "patching", "logprob_diff")
    assert curve[0.0]["faithfulness"] == 0 and curve[100.0]["faithfulness"] == pytest.approx(1.0, abs=1e-12)


def test_cpr_and_cmd_are_mibs_trapezoids(study):
    wh, _, _, _ = study
    curve = {r["share"]: r["faithfulness"] for r in _rows(wh, "SELECT * FROM circuit_curve WHERE size > 0")}
    x = sorted(curve)
    cpr = sum((x[i + 1] - x[i]) * (curve[x[i]] + curve[x[i + 1]]) / 2 for i in range(len(x) - 1))
    cmd = sum((x[i + 1] - x[i]) * (abs(1 - curve[x[i]]) + abs(1 - curve[x[i + 1]])) / 2 for i in range(len(x) - 1))
    (score,) = _rows(wh, "SELECT * FROM circuit_score")
    assert score["cpr"] == pytest.approx(cpr, abs=1e-9) and score["cmd"] == pytest.approx(cmd, abs=1e-9)
    assert score["n_sizes"] == len(SIZES) and score["max_share"] == 1.0


def test_circuit_edges_are_the_first_of_the_order(study):
    wh, _, order, _ = study
    graph = EdgeGraph.of(SHAPE)
    got = _rows(wh, "SELECT * FROM circuit_edges WHERE run_id = 'r' ORDER BY size, rank")
    for size in (0.0, *SIZES):
        n = circuit_size(size, len(graph.edges))
        mine = [(r["sender"], r["receiver"]) for r in got if r["size"] == size]
        want = [(graph.senders[graph.edges[e][0]], graph.receivers[graph.edges[e][1]]) for e in order[:n]]
        assert mine == want, size
    assert all(r["n_edges"] == circuit_size(r["size"], len(graph.edges)) for r in got)


def test_circuit_rows_are_in_no_effect_view(study):
    wh, _, _, _ = study
    for view in ("pair_effects", "effect_summary", "effect_metrics", "atp_effects"):
        (n,) = _rows(wh, f"SELECT count(*) AS n FROM {view} WHERE sweep = 'circuit'")
        assert n["n"] == 0, view


def test_the_report_draws_the_curve_and_a_circuit(study):
    from patchgrid.report.circuit_figures import circuit_section
    from patchgrid.report.circuit_svg import svg_circuit, svg_curve
    from patchgrid.warehouse.loader import connect

    wh, _, order, _ = study
    con = connect(wh)
    try:
        section = circuit_section(con, "r", "circuit")
    finally:
        con.close()
    (label, points), = section["curve"].series
    assert label.endswith("topn, patching") and [p[0] for p in points] == [s / 100 for s in SIZES]
    assert svg_curve(section["curve"]).count("<circle") == len(SIZES)
    d = section["diagram"]
    graph = EdgeGraph.of(SHAPE)
    assert (d.n_layers, d.n_heads, d.n_kv_heads) == (SHAPE.n_layers, SHAPE.n_heads, SHAPE.kv_heads)
    want = [(graph.senders[graph.edges[e][0]], graph.receivers[graph.edges[e][1]]) for e in order]
    assert [(s, r) for s, r, _ in d.edges] == want[:len(d.edges)]
    # an edge into a key or value head goes to each head of its group
    lines = sum(len(d.node(s)) * len(d.node(r)) for s, r, _ in d.edges)
    assert svg_circuit(d).count("<line") == lines
    assert [r["ablation"] for r in section["scores"]] == ["patching"]


def test_the_report_draws_the_circuit_asked_for_and_refuses_a_size_the_run_has_not(study):
    from patchgrid.report.circuit_figures import circuit_section
    from patchgrid.warehouse.loader import connect

    wh, _, _, _ = study
    con = connect(wh)
    try:
        d = circuit_section(con, "r", "circuit", 20.0)["diagram"]
        assert "at 20% of the edges" in d.title and "the size asked for" in d.caption
        with pytest.raises(ValueError, match=r"--circuit-size 3: run r's circuits have sizes 10, 20, 50, 100"):
            circuit_section(con, "r", "circuit", 3.0)
    finally:
        con.close()
