"""Attribution patching in the warehouse: atp_summary and atp_agreement against a computation in
Python on the same stored rows, and the effect views leaving atp rows out."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from patchgrid.pairs import to_table as pairs_table
from patchgrid.sweeps.registry import row_shapes
from patchgrid.warehouse.loader import load_run, query, start_run
from tests.support.effect_rows import CLEAN, CORRUPT, atp_row, make_pair, row, shifted, write_and_read_back

ROLES = ("subject_first", "subject_last", "further", "further", "last")
N_LAYERS, N_HEADS, N_NEURONS = 3, 4, 8
TOP_K, RANDOM_R = 3, 4
THRESHOLD = 0.1
T975 = [None, 12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622]
# per site kind: its sites (layer, position, head, neuron), and the exact sweep that patches it alone
SITES = {
    "resid": [(layer, pos, None, None) for layer in range(N_LAYERS) for pos in [None, *range(len(ROLES))]],
    "attn_out": [(layer, pos, None, None) for layer in range(N_LAYERS) for pos in range(len(ROLES))],
    "head": [(layer, pos, head, None) for layer in range(N_LAYERS) for pos in (None, len(ROLES) - 1)
             for head in range(N_HEADS)],
    "neuron": [(layer, None, None, neuron) for layer in range(N_LAYERS) for neuron in range(N_NEURONS)],
}
EXACT_SWEEP = {"resid": "resid", "head": "heads", "neuron": "neurons"}  # attn_out: no exhaustive sweep


def pair_record(pid):
    return {"pair_id": pid, "relation": "r", "status": "accepted", "clean_prompt": f"c{pid}",
            "corrupt_prompt": f"x{pid}", "roles": list(ROLES), "subject_start": 0, "subject_end": 2}


def scope(site):
    """A site's scope as the sweep and the views name it: position None is every position at once."""
    return "every_position" if site[1] is None else "per_position"


def synthetic(seed=3):
    """Six pairs, all on logprob_diff as the atp sweep writes them (p5's answers scored whole: it has
    no logit_diff); per pair, site kind and scope, every site screened with an estimate near its
    true effect, the top 3 by the ranking score (GradDrop for neurons) and a random 4 of the others
    (or all of them, when fewer) verified; exhaustive exact sweeps of resid (both directions), heads
    (p1 misses one site) and neurons; causal tracing rows at the resid sites. Returns (atp rows,
    exact rows)."""
    rng = random.Random(seed)
    atp, exact = [], []
    for i in range(6):
        pid = f"p{i}"
        pair = make_pair(pid, ROLES, subject=(0, 2))
        clean, corrupt, metric = CLEAN, CORRUPT, "logprob_diff"
        if i == 5:
            clean, corrupt = shifted(CLEAN, logit_diff=None), shifted(CORRUPT, logit_diff=None)
        span = clean.value(metric) - corrupt.value(metric)
        for site, sites in SITES.items():
            truth, estimate, graddrop = {}, {}, {}
            for s in sites:
                r = rng.uniform(0.12, 1.0) * rng.choice((-1, 1)) if rng.random() < 0.3 else rng.uniform(-0.08, 0.08)
                truth[s] = r
                estimate[s] = r * span * rng.uniform(0.5, 1.5) + rng.gauss(0, 0.4)
                graddrop[s] = abs(estimate[s]) + rng.uniform(0, 0.6) if site == "neuron" else None
            score = graddrop if site == "neuron" else {s: abs(e) for s, e in estimate.items()}
            top, sample = [], []
            for where in ("every_position", "per_position"):
                group = [s for s in sites if scope(s) == where]
                chosen = sorted(group, key=lambda s: -score[s])[:TOP_K]
                others = [s for s in group if s not in chosen]
                top += chosen
                if (site, pid) != ("attn_out", "p0"):
                    sample += rng.sample(others, min(RANDOM_R, len(others)))
            for s in sites:
                layer, position, head, neuron = s
                verify = "top" if s in top else "random" if s in sample else None
                atp.append(atp_row(pair, estimate[s], site=site, layer=layer, position=position, head=head,
                                   neuron=neuron, verify=verify, r=truth[s] if verify else None,
                                   graddrop=graddrop[s], metric=metric, clean=clean, corrupt=corrupt))
                if site in EXACT_SWEEP and not (site, pid, s) == ("head", "p1", sites[5]):
                    exact.append(row(pair, truth[s], sweep=EXACT_SWEEP[site], site=site, layer=layer,
                                     position=position, head=head, neuron=neuron, metric=metric, clean=clean,
                                     corrupt=corrupt))
                if site == "resid":  # noising rows, and causal tracing rows, at the same coordinates
                    exact.append(row(pair, rng.uniform(0, 1), direction="noise", layer=layer, position=position,
                                     metric=metric, clean=clean, corrupt=corrupt))
                    if position is not None:
                        exact.append(row(pair, rng.uniform(0, 1), sweep="trace", layer=layer, position=position,
                                         metric="p", clean=clean, corrupt=corrupt))
    return atp, exact


def load(tmp_path, rows, run_id="r", name="w"):
    wh = tmp_path / f"{name}.duckdb"
    f, stored = write_and_read_back(rows, tmp_path / f"{name}-{run_id}.parquet")
    start_run(wh, {"run_id": run_id, "model": "m"})
    load_run(wh, run_id, pairs_table([pair_record(f"p{i}") for i in range(6)]), [], [f], sweep_kinds=row_shapes())
    return wh, stored


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("atp")
    atp, exact = synthetic()
    wh, stored = load(tmp, atp + exact)
    return wh, stored


def _rows(wh, sql, params=None):
    cols, rows = query(wh, sql, params)
    return [dict(zip(cols, r)) for r in rows]


def approx(v):
    return None if v is None else pytest.approx(v, rel=1e-9, abs=1e-12)


def _mean(values):
    return statistics.mean(values) if values else None


def python_atp_summary(stored):
    """atp_summary computed from the stored rows: each pair's rows of a role averaged, then pairs."""
    per_pair = {}
    for r in stored:
        if r["sweep"] != "atp":
            continue
        cell = (r["site"], r["metric"], r["layer"], r["position_role"], r["head"], r["neuron"])
        per_pair.setdefault(cell, {}).setdefault(r["pair_id"], []).append(r)
    out = {}
    for cell, pairs in per_pair.items():
        estimates, graddrops, effects, verified_estimates = [], [], [], []
        for rows in pairs.values():
            estimates.append(statistics.mean(r["estimate"] for r in rows))
            if any(r["estimate_graddrop"] is not None for r in rows):
                graddrops.append(statistics.mean(r["estimate_graddrop"] for r in rows
                                                 if r["estimate_graddrop"] is not None))
            verified = [r for r in rows if r["effect"] is not None]
            if verified:
                effects.append(statistics.mean(r["effect"] for r in verified))
                verified_estimates.append(statistics.mean(r["estimate"] for r in verified))
        n = len(estimates)
        mean = statistics.mean(estimates)
        sd = statistics.stdev(estimates) if n > 1 else None
        half = None if sd is None else T975[n - 1] * sd / math.sqrt(n)
        out[cell] = {"n_pairs": n, "mean_estimate": mean, "sd_estimate": sd,
                     "estimate_ci95_low": None if half is None else mean - half,
                     "estimate_ci95_high": None if half is None else mean + half,
                     "mean_graddrop": _mean(graddrops), "n_verified": len(effects), "mean_effect": _mean(effects),
                     "mean_estimate_verified": _mean(verified_estimates)}
    return out


def pearson(xs, ys):
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return sxy / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))


def spearman(xs, ys):
    """Spearman's rho: Pearson's of the ranks, ties given their mean rank (pandas' average ranks)."""
    import pandas as pd

    return pearson(list(pd.Series(xs).rank(method="average")), list(pd.Series(ys).rank(method="average")))


MIN_SPAN = 0.5  # logprob_diff's smallest span clean - corrupt a recovery is read from


def _pair_figures(pid, rs, exact):
    """One pair's (outside, inside) of missed_share (None when it does not enter), and its recalls."""
    top = [r for r in rs if r["verify"] == "top"]
    rand = [r for r in rs if r["verify"] == "random"]
    guarded = rs[0]["clean_logprob_diff"] - rs[0]["corrupt_logprob_diff"] >= MIN_SPAN
    important = [r for r in rs if guarded and r["recovery"] is not None and abs(r["recovery"]) >= THRESHOLD]
    n_others = len(rs) - len(top)
    missed = None
    if guarded and (n_others == 0 or rand):
        missed = (0.0 if n_others == 0 else sum(r in rand for r in important) / len(rand) * n_others,
                  sum(r in top for r in important))
    coords = [(pid, r["site"], r["metric"], r["layer"], r["position"], r["head"], r["neuron"]) for r in rs]
    recall = None
    if all(c in exact for c in coords) and top:
        order = sorted(range(len(rs)), key=lambda k: -abs(exact[coords[k]]))
        marked = {k for k, r in enumerate(rs) if r["verify"] == "top"}
        recall = (len(marked & set(order[:len(top)])) / len(top), len(marked & set(order[:10])) / min(10, len(rs)))
    return guarded, missed, recall


def python_atp_agreement(stored):
    """atp_agreement computed from the stored rows, by its definition in views.sql: per (site kind,
    scope, metric)."""
    site_of = {"resid": "resid", "heads": "head", "neurons": "neuron"}
    exact = {}  # (pair, site, metric, layer, position, head, neuron) -> exact effect patched - corrupt
    for r in stored:
        if r["sweep"] in site_of and r["direction"] == "denoise":
            m = r["metric"]
            exact[(r["pair_id"], r["site"], m, r["layer"], r["position"], r["head"], r["neuron"])] = \
                r[f"patched_{m}"] - r[f"corrupt_{m}"]
    groups = {}
    for r in stored:
        if r["sweep"] == "atp":
            where = "every_position" if r["position"] is None else "per_position"
            groups.setdefault((r["site"], where, r["metric"]), {}).setdefault(r["pair_id"], []).append(r)
    out = {}
    for key, pairs in groups.items():
        rows = [r for rs in pairs.values() for r in rs]
        verified = [r for r in rows if r["verify"] is not None]
        rand = [r for r in verified if r["verify"] == "random"]
        figures = [_pair_figures(pid, rs, exact) for pid, rs in pairs.items()]
        missed = [m for _, m, _ in figures if m is not None]
        recalls = [c for *_, c in figures if c is not None]
        total = sum(o + i for o, i in missed)
        xs, ys = [r["estimate"] for r in rand], [r["effect"] for r in rand]
        out[key] = {
            "n_pairs": len(pairs), "n_sites": len(rows), "n_top": sum(r["verify"] == "top" for r in rows),
            "n_random": len(rand), "n_verified": len(verified),
            "ranked_by": "graddrop" if any(r["estimate_graddrop"] is not None for r in rows) else "abs_estimate",
            "n_random_verified": len(rand), "n_pairs_random": len({r["pair_id"] for r in rand}),
            "pearson_random": pearson(xs, ys) if len(rand) > 1 else None,
            "spearman_random": spearman(xs, ys) if len(rand) > 1 else None,
            "pearson_pooled": pearson([r["estimate"] for r in verified], [r["effect"] for r in verified])
            if len(verified) > 1 else None,
            "threshold": THRESHOLD, "n_pairs_missed": len(missed),
            "n_pairs_unguarded": sum(not g for g, *_ in figures),
            "missed_share": sum(o for o, _ in missed) / total if total else None,
            "n_pairs_exact": len(recalls), "recall_top_k": _mean([k for k, _ in recalls]),
            "recall_top_10": _mean([t for _, t in recalls])}
    return out


def test_atp_summary_matches_a_direct_computation(study):
    wh, stored = study
    got = {(r.pop("site"), r.pop("metric"), r.pop("layer"), r.pop("position_role"), r.pop("head"), r.pop("neuron")): r
           for r in _rows(wh, "SELECT * EXCLUDE (run_id) FROM atp_summary")}
    want = python_atp_summary(stored)
    assert set(got) == set(want)
    for cell, w in want.items():
        assert got[cell] == {k: approx(v) for k, v in w.items()}, cell
    # what the data holds: two further positions averaged per pair, p5 on its own metric (one pair:
    # no interval), GradDrop only for neurons, some cells verified in no pair; every pair on logprob_diff
    assert len(want) == 3 * 5 + 3 * 4 + 24 + 24
    assert got[("resid", "logprob_diff", 0, "last", None, None)]["n_pairs"] == 6
    assert got[("resid", "logprob_diff", 0, "further", None, None)]["n_pairs"] == 6
    assert {c[0] for c, w in want.items() if w["mean_graddrop"] is not None} == {"neuron"}
    assert any(w["n_verified"] == 0 and w["mean_effect"] is None for w in want.values())
    assert all(0 < w["n_verified"] <= w["n_pairs"] for c, w in want.items() if w["mean_effect"] is not None)
    # t on n_pairs - 1 = 5 degrees of freedom, not 1.96
    s = got[("head", "logprob_diff", 2, "all", 3, None)]
    assert s["estimate_ci95_high"] - s["mean_estimate"] == pytest.approx(2.5706 * s["sd_estimate"] / math.sqrt(6))


def test_atp_agreement_matches_a_direct_computation(study):
    wh, stored = study
    got = {(r.pop("site"), r.pop("scope"), r.pop("metric")): r
           for r in _rows(wh, "SELECT * EXCLUDE (run_id) FROM atp_agreement")}
    want = python_atp_agreement(stored)
    scopes = {site: {scope(s) for s in sites} for site, sites in SITES.items()}
    assert set(got) == set(want) == {(s, w, "logprob_diff") for s in SITES for w in scopes[s]}
    for key, w in want.items():
        assert got[key] == {k: approx(v) if isinstance(v, float) else v for k, v in w.items()}, key
    resid = got[("resid", "per_position", "logprob_diff")]
    # 6 pairs x 15 per-position sites, 3 top and 4 random each; estimates follow the effects closely
    assert (resid["n_pairs"], resid["n_sites"], resid["n_top"], resid["n_random"]) == (6, 90, 18, 24)
    assert resid["n_verified"] == 42 and resid["pearson_random"] > 0.5 and resid["ranked_by"] == "abs_estimate"
    # the pooled correlation takes the top K, chosen by the estimates: higher than over the random rows
    assert resid["pearson_pooled"] > resid["pearson_random"]
    # every position at once: 3 sites per pair, all of them top
    every = got[("resid", "every_position", "logprob_diff")]
    assert (every["n_sites"], every["n_top"], every["n_random"], every["missed_share"]) == (18, 18, 0, 0.0)
    assert got[("neuron", "every_position", "logprob_diff")]["ranked_by"] == "graddrop"
    assert 0 < resid["missed_share"] < 1 and resid["threshold"] == pytest.approx(0.1)
    assert all(a["n_pairs_unguarded"] == 0 for a in got.values())
    # attn_out: p0 has no random sample (it enters no sum), and no exhaustive sweep: no recall
    attn = got[("attn_out", "per_position", "logprob_diff")]
    assert attn["n_pairs_missed"] == 5 and attn["n_pairs_exact"] == 0 and attn["recall_top_k"] is None
    assert attn["recall_top_10"] is None
    # heads: each scope its own top 3 and sample; p1's exhaustive sweep misses a site at one position
    # (layer 0, the last, head 1), so p1 has no recall there
    heads = {w: got[("head", w, "logprob_diff")] for w in ("every_position", "per_position")}
    assert all((h["n_sites"], h["n_top"], h["n_random"]) == (72, 18, 24) for h in heads.values())
    assert heads["every_position"]["n_pairs_exact"] == 6 and heads["per_position"]["n_pairs_exact"] == 5
    # the noising and tracing rows at resid's coordinates are never taken for the exact effects
    assert resid["n_pairs_exact"] == 6 and 0 < resid["recall_top_k"] <= 1 and 0 < resid["recall_top_10"] <= 1


def test_missed_share_and_recall_on_a_pair_worked_by_hand(tmp_path):
    """One pair, twelve resid sites: the estimates rank sites 0-2 top; sites 3-4 are sampled. Site 1
    (top) and site 3 (random) are important, site 4 is not: outside = 1/2 x 9 = 4.5, inside = 1,
    missed_share = 4.5 / 5.5. The exact sweep's top 3 by |effect| are sites 3, 1, 9: recall 1/3;
    its top 10 leave out sites 5 and 2, so 2 of them were marked top: 2/10."""
    pair = make_pair("p0", ROLES, subject=(0, 2))
    truth = [0.05, 0.6, 0.001, -0.9, 0.03, 0.011, 0.02, 0.04, 0.06, -0.5, 0.07, 0.08]
    estimates = [2.0, -1.9, 1.8, -0.5, 0.1, 0.0, 0.0, 0.1, 0.2, -0.3, 0.1, 0.1]
    verify = ["top", "top", "top", "random", "random"] + [None] * 7
    rows = []
    for layer, (r, e, v) in enumerate(zip(truth, estimates, verify)):
        rows.append(atp_row(pair, e, layer=layer, verify=v, r=r if v else None))
        rows.append(row(pair, r, layer=layer))
    wh, _ = load(tmp_path, rows)
    a = _rows(wh, "SELECT * FROM atp_agreement")
    assert len(a) == 1
    a = a[0]
    assert (a["n_pairs"], a["n_sites"], a["n_top"], a["n_random"], a["n_verified"]) == (1, 12, 3, 2, 5)
    assert a["missed_share"] == pytest.approx(4.5 / 5.5)
    assert (a["n_pairs_exact"], a["recall_top_k"], a["recall_top_10"]) == (1, pytest.approx(1 / 3), pytest.approx(0.2))
    xs, ys = estimates[:5], [t * 4.0 for t in truth[:5]]  # effect = recovery x the logit-difference span 4
    assert a["pearson_pooled"] == pytest.approx(pearson(xs, ys), rel=1e-6)
    # over the random sites alone: sites 3 and 4, two points, on a line rising from (-0.5, -3.6) to (0.1, 0.12)
    assert a["pearson_random"] == pytest.approx(1.0) and a["spearman_random"] == pytest.approx(1.0)
    assert (a["scope"], a["n_random_verified"], a["n_pairs_random"], a["n_pairs_unguarded"]) == ("every_position",
                                                                                                 2, 1, 0)


def test_atp_rows_without_verified_sites(tmp_path):
    """A run that only estimated (no site patched exactly): the estimates are summarised, no
    effect view has a row, and the agreement's exact-patching numbers are NULL."""
    pair = make_pair("p0", ROLES, subject=(0, 2))
    wh, _ = load(tmp_path, [atp_row(pair, 0.1 * layer, layer=layer) for layer in range(4)])
    for view in ("effect_metrics", "pair_effects", "effect_summary", "effect_summary_facts", "relation_summary",
                 "trace_buckets"):
        assert query(wh, f"SELECT count(*) FROM {view}")[1] == [(0,)], view
    s = _rows(wh, "SELECT layer, n_pairs, mean_estimate, n_verified, mean_effect FROM atp_summary ORDER BY layer")
    assert [(r["layer"], r["n_pairs"], r["n_verified"], r["mean_effect"]) for r in s] == [(k, 1, 0, None)
                                                                                          for k in range(4)]
    a = _rows(wh, "SELECT * FROM atp_agreement")[0]
    assert (a["n_sites"], a["n_top"], a["n_random"], a["n_verified"]) == (4, 0, 0, 0)
    assert a["pearson_random"] is None and a["spearman_random"] is None and a["pearson_pooled"] is None
    assert a["missed_share"] is None and a["recall_top_k"] is None and a["n_random_verified"] == 0
    assert a["n_pairs_missed"] == 0


def test_effect_views_leave_atp_rows_out(tmp_path, study):
    """Every effect view holds the same rows with and without the atp rows beside the exact ones."""
    wh, stored = study
    exact_only, _ = load(tmp_path, [r for r in stored if r["sweep"] != "atp"], name="exact")
    for view in ("effect_metrics", "pair_effects", "pair_effects_judged", "effect_summary", "effect_summary_facts",
                 "relation_summary", "trace_buckets"):
        with_atp, without = (query(w, f"SELECT * FROM {view} ORDER BY ALL")[1] for w in (wh, exact_only))
        assert len(with_atp) == len(without) > 0, view
        for a, b in zip(with_atp, without):
            assert list(a) == [pytest.approx(v, rel=1e-12) if isinstance(v, float) else v for v in b], view
    assert query(wh, "SELECT count(*) FROM effect_summary WHERE sweep = 'atp'")[1] == [(0,)]


def test_neurons_are_cells_of_their_own(study):
    """The exhaustive neuron sweep: effect_summary has one cell per neuron, each the mean over its
    pairs of that neuron's effect."""
    wh, stored = study
    got = {(layer, neuron): (n, mean) for layer, neuron, n, mean in query(
        wh, "SELECT layer, neuron, n_pairs, mean_effect FROM effect_summary WHERE sweep = 'neurons' "
            "AND metric = 'logit_diff'")[1]}
    assert len(got) == N_LAYERS * N_NEURONS
    for (layer, neuron), (n, mean) in got.items():
        effects = [r["patched_logit_diff"] - r["corrupt_logit_diff"] for r in stored if r["sweep"] == "neurons"
                   and (r["layer"], r["neuron"]) == (layer, neuron) and r["patched_logit_diff"] is not None]
        assert n == len(effects) == 5 and mean == pytest.approx(statistics.mean(effects), rel=1e-9)


def test_atp_views_unique_and_not_null(study):
    """dbt-style tests: each view's rows unique on its key; keys, counts and means never null."""
    wh, _ = study
    for view, key, required in (
            ("atp_exact_sweeps", "site", "site, sweep"),
            ("atp_pair_estimates", "run_id, pair_id, site, metric, layer, position_role, head, neuron",
             "run_id, pair_id, site, metric, layer, position_role, n_positions, estimate, n_verified_positions"),
            ("atp_summary", "run_id, site, metric, layer, position_role, head, neuron",
             "run_id, site, metric, layer, position_role, n_pairs, mean_estimate, n_verified"),
            ("atp_sites", "run_id, pair_id, site, metric, layer, position, head, neuron",
             "run_id, pair_id, site, scope, metric, estimate, span, span_ok, important"),
            ("atp_agreement_pairs", "run_id, site, scope, metric, pair_id",
             "run_id, site, scope, metric, pair_id, n_sites, n_top, n_random, span_ok"),
            ("atp_agreement", "run_id, site, scope, metric",
             "run_id, site, scope, metric, n_pairs, n_sites, n_top, n_random, n_verified, ranked_by, threshold, "
             "n_random_verified, n_pairs_random, n_pairs_missed, n_pairs_unguarded, n_pairs_exact"),
            ("effect_summary", "run_id, sweep, site, direction, metric, layer, position_role, head, neuron",
             "n_pairs, metric, mean_effect")):
        dup = query(wh, f"SELECT count(*) FROM (SELECT {key}, count(*) c FROM {view} GROUP BY ALL HAVING c > 1)")[1]
        assert dup == [(0,)], view
        nulls = " OR ".join(f"{c.strip()} IS NULL" for c in required.split(","))
        assert query(wh, f"SELECT count(*) FROM {view} WHERE {nulls}")[1] == [(0,)], view
    # a head cell names its head, a neuron cell its neuron, and no other cell either
    assert query(wh, "SELECT count(*) FROM atp_summary WHERE (head IS NULL) = (site = 'head') "
                     "OR (neuron IS NULL) = (site = 'neuron')")[1] == [(0,)]
    # the counts behind each number add up
    assert query(wh, "SELECT count(*) FROM atp_summary WHERE n_verified > n_pairs OR (mean_effect IS NULL) "
                     "<> (n_verified = 0)")[1] == [(0,)]
    assert query(wh, "SELECT count(*) FROM atp_agreement WHERE n_top + n_random > n_sites OR n_verified "
                     "<> n_top + n_random OR n_pairs_missed > n_pairs OR n_pairs_exact > n_pairs "
                     "OR missed_share NOT BETWEEN 0 AND 1 OR recall_top_k NOT BETWEEN 0 AND 1 "
                     "OR n_random_verified <> n_random OR n_pairs_random > n_pairs "
                     "OR pearson_random NOT BETWEEN -1 AND 1 OR spearman_random NOT BETWEEN -1 AND 1")[1] == [(0,)]


def test_exact_sweeps_are_the_kinds_that_patch_each_site(study):
    from patchgrid.sweeps import kind_for_site

    wh, _ = study
    for site, sweep in query(wh, "SELECT site, sweep FROM atp_exact_sweeps")[1]:
        assert kind_for_site(site).name == sweep
