"""Edge attribution in the warehouse: the edges sweep's rows (EdgeSweep.rows, from scores made
here) loaded, and edge_summary against a computation by hand with scipy's t quantile; the edge rows
stay out of attribution patching's views and the effect views."""
from __future__ import annotations

import math
import statistics

import pytest
import torch
from scipy import stats

from patchgrid.methods.graph import EdgeGraph
from patchgrid.model.sites import FAMILIES, ModelShape
from patchgrid.sweeps import SweepConfig
from patchgrid.sweeps.base import SweepContext
from patchgrid.sweeps.edges import EdgeSweep
from patchgrid.warehouse.loader import query
from tests.support.effect_rows import baseline, between, make_pair
from tests.unit.warehouse.test_path_views import N_PAIRS, ROLES, load

SHAPE = ModelShape(FAMILIES["llama"], 2, 2, 8, 16, 50, 32, 32, 1)


def random_edge_scores(seed: int):
    """SHAPE's edge graph, N_PAIRS pairs and every edge of each pair scored at random (seeded), as the
    edges sweep's prepared state holds them, no edge verified yet: (graph, pairs, prepared state)."""
    graph = EdgeGraph.of(SHAPE)
    gen = torch.Generator().manual_seed(seed)
    pairs = [make_pair(f"p{i}", ROLES, subject=(0, 2)) for i in range(N_PAIRS)]
    scores = {p.pair_id: torch.randn(len(graph.senders), len(graph.receivers), generator=gen) * graph.mask()
              for p in pairs}
    edges = graph.edges
    prepared = {"edges": [(graph.senders[i], graph.receivers[j]) for i, j in edges],
                "index": ([i for i, _ in edges], [j for _, j in edges]), "scores": scores, "verify": {}, "first": {}}
    return graph, pairs, prepared


def edge_rows(method="eap-ig", verify=(0, 0)):
    """Every edge of every pair with a random score; with verify = (K, R), the sweep's own choice of
    the top K and R random edges per pair, each patched exactly to a recovery of 0.1 x its score
    plus a pair's own noise."""
    graph, pairs, got = random_edge_scores(5)
    config = SweepConfig(sweeps=("edges",), edge_method=method, verify_top=verify[0], verify_random=verify[1])
    ctx = SweepContext(config, SHAPE.n_layers, SHAPE.n_heads, prepared={"edges": got})
    kind = EdgeSweep({})
    rows = []
    for k, p in enumerate(pairs):
        readings = []
        if any(verify):
            got["verify"][p.pair_id] = kind.chosen(p, ctx)
            scored = dict(kind.edge_cells(p, ctx))
            readings = [(c, between(0.1 * scored[c] + 0.05 * math.sin(k + j))) for j, c in
                        enumerate(got["verify"][p.pair_id])]
        rows += kind.rows(p, readings, baseline(p.pair_id), ctx)
    return rows, graph


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    rows, graph = edge_rows()
    wh, stored = load(tmp_path_factory.mktemp("edges"), rows,
                      params={"edge_method": "eap-ig", "ig_steps": 30, "edge_positions": "summed"})
    return wh, stored, graph


def _rows(wh, sql):
    cols, rows = query(wh, sql)
    return [dict(zip(cols, r)) for r in rows]


def test_edge_summary_matches_a_hand_computation(study):
    wh, stored, graph = study
    cells = {}
    for r in stored:
        cells.setdefault((r["sender"], r["receiver"]), []).append(r["estimate"])
    assert len(cells) == len(graph.edges)
    got = {(s["sender"], s["receiver"]): s for s in _rows(wh, "SELECT * FROM edge_summary WHERE run_id = 'r'")}
    assert set(got) == set(cells)
    for key, values in cells.items():
        s = got[key]
        n, mean, sd = len(values), statistics.mean(values), statistics.stdev(values)
        half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
        assert s["n_pairs"] == N_PAIRS == n
        assert (s["mean_score"], s["score_ci95_low"], s["score_ci95_high"]) == pytest.approx(
            (mean, mean - half, mean + half), rel=1e-4, abs=5e-5), key  # t975(): an approximation
        assert s["mean_abs_score"] == pytest.approx(statistics.mean(abs(v) for v in values), rel=1e-6)
        assert s["method"] == "eap-ig" and s["ig_steps"] == 30 and s["metric"] == "logprob_diff"
        assert s["position_role"] == "all"
    one = got[("head.0.1", "k.1.0")]
    assert (one["receiver_input"], one["receiver_layer"], one["receiver_head"]) == ("k", 1, 0)
    assert (one["sender_site"], one["sender_layer"], one["sender_head"]) == ("head", 0, 1)
    logits = got[("input", "logits")]
    assert (logits["receiver_input"], logits["receiver_layer"], logits["receiver_head"]) == ("logits", None, None)
    assert (logits["sender_site"], logits["sender_layer"]) == ("resid_pre", 0)
    assert got[("head.1.0", "mlp_in.1")]["receiver_input"] == "mlp_in"


def test_edge_rows_stay_out_of_the_atp_and_effect_views(study):
    wh, _, _ = study
    for view in ("atp_summary", "atp_effects", "effect_summary", "effect_metrics"):
        assert _rows(wh, f"SELECT count(*) AS n FROM {view}")[0]["n"] == 0, view


def test_the_report_draws_the_strongest_edges(study, tmp_path):
    from patchgrid.report import write_report

    wh, stored, graph = study
    page = write_report(wh, tmp_path, run_id="r", formats=("svg",)).read_text()
    assert "Edge attribution (EAP and EAP-IG scores)" in page
    assert f"every one of the model's {len(graph.edges)} edges" in page
    assert "EAP-IG (Hanna et al. 2024), 30 steps" in page
    assert (tmp_path / "edges-all.svg").exists()
    # the strongest edge by |mean score| is drawn
    means = {}
    for r in stored:
        means.setdefault((r["sender"], r["receiver"]), []).append(r["estimate"])
    top = max(means, key=lambda k: abs(statistics.mean(means[k])))
    assert f">{top[0]}<" in page and f">{top[1]}<" in page
    assert page.index(">input<") < page.index(">head.0.0<")  # the input first, then by layer


def test_edge_agreement_matches_a_hand_computation(tmp_path):
    from patchgrid.warehouse.agreement import edge_agreement
    from patchgrid.warehouse.loader import connect

    rows, graph = edge_rows(verify=(4, 6))
    wh, stored = load(tmp_path, rows, params={"edge_method": "eap", "verify_top": 4, "verify_random": 6})
    verified = [r for r in stored if r["verify"] is not None]
    assert len(verified) == 10 * N_PAIRS
    span = 2.5 - (-2.5)  # logprob_diff, clean - corrupt (tests.support.effect_rows)
    import numpy as np

    random_rows = [r for r in verified if r["verify"] == "random"]
    xs, ys = np.array([r["estimate"] for r in random_rows]), np.array([r["effect"] for r in random_rows])
    outside = inside = 0.0
    for i in range(N_PAIRS):
        mine = [r for r in verified if r["pair_id"] == f"p{i}"]
        n_edges = len([r for r in stored if r["pair_id"] == f"p{i}"])
        important = [abs(r["effect"] / span) >= 0.1 for r in mine]
        top = sum(1 for r, imp in zip(mine, important) if imp and r["verify"] == "top")
        rnd = sum(1 for r, imp in zip(mine, important) if imp and r["verify"] == "random")
        outside += rnd / 6 * (n_edges - 4)
        inside += top
    got = _rows(wh, "SELECT * FROM edge_agreement WHERE run_id = 'r'")
    assert len(got) == 1
    a = got[0]
    assert (a["n_pairs"], a["n_top"], a["n_random"], a["n_verified"]) == (N_PAIRS, 4 * N_PAIRS, 6 * N_PAIRS,
                                                                          10 * N_PAIRS)
    assert a["n_edges"] == len(graph.edges) * N_PAIRS
    assert a["pearson_random"] == pytest.approx(float(np.corrcoef(xs, ys)[0, 1]), abs=1e-6)
    assert a["spearman_random"] == pytest.approx(stats.spearmanr(xs, ys).statistic, abs=1e-6)
    assert a["missed_share"] == pytest.approx(outside / (outside + inside), rel=1e-6)
    assert a["recall_important"] == pytest.approx(inside / (outside + inside), rel=1e-6)
    con = connect(wh)
    try:
        (b,) = edge_agreement(con, "r", resamples=200)
    finally:
        con.close()
    for name in ("pearson_random", "spearman_random", "missed_share", "recall_important"):
        assert b[f"{name}_ci95_low"] <= b[name] <= b[f"{name}_ci95_high"], name
    assert b["recall_important_ci95_low"] == pytest.approx(1 - b["missed_share_ci95_high"])


def test_the_report_shows_the_edges_agreement(tmp_path):
    from patchgrid.report import write_report

    rows, _ = edge_rows(verify=(4, 6))
    wh, _ = load(tmp_path, rows, params={"edge_method": "eap", "verify_top": 4, "verify_random": 6})
    page = write_report(wh, tmp_path / "out", run_id="r", formats=("svg",)).read_text()
    assert "Agreement with exact patching (edge_agreement)" in page and "recall of important edges" in page
