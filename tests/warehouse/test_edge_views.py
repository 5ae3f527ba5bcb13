"""Edge attribution in the warehouse: the edges sweep's rows (EdgeSweep.rows, from scores made
here) loaded, and edge_summary against a computation by hand with scipy's t quantile; the edge rows
stay out of attribution patching's views and the effect views."""
from __future__ import annotations

import math
import statistics

import pytest
import torch
from scipy import stats

from patchgrid.graph import EdgeGraph
from patchgrid.sites import FAMILIES, ModelShape
from patchgrid.sweeps import SweepConfig
from patchgrid.sweeps.base import SweepContext
from patchgrid.sweeps.edges import EdgeSweep
from patchgrid.warehouse.loader import query
from tests.support.effect_rows import make_pair
from tests.warehouse.test_path_views import N_PAIRS, ROLES, load

SHAPE = ModelShape(FAMILIES["llama"], 2, 2, 8, 16, 50, 32, 32, 1)


def edge_rows(method="eap-ig"):
    graph = EdgeGraph.of(SHAPE)
    gen = torch.Generator().manual_seed(5)
    pairs = [make_pair(f"p{i}", ROLES, subject=(0, 2)) for i in range(N_PAIRS)]
    scores = {p.pair_id: torch.randn(len(graph.senders), len(graph.receivers), generator=gen) * graph.mask()
              for p in pairs}
    edges = graph.edges
    ctx = SweepContext(SweepConfig(sweeps=("edges",), edge_method=method), SHAPE.n_layers, SHAPE.n_heads,
                       prepared={"edges": {"edges": [(graph.senders[i], graph.receivers[j]) for i, j in edges],
                                           "index": ([i for i, _ in edges], [j for _, j in edges]),
                                           "scores": scores, "verify": {}, "first": {}}})
    kind = EdgeSweep({})
    return [r for p in pairs for r in kind.rows(p, [], {}, ctx)], graph


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
