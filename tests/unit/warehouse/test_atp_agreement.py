"""Attribution patching's agreement figures as their definitions compute them: the correlations over
the random sites alone (numpy's Pearson, pandas' average ranks for Spearman), bootstrap intervals
over pairs (an independent resampling in the test), the span guard on the importance threshold,
the per-scope split of the top K, and one metric name for every pair."""
from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest

from patchgrid.pairs import to_table as pairs_table
from patchgrid.pairs.pair import Pair
from patchgrid.sweeps import SweepConfig
from patchgrid.sweeps.base import SweepContext
from patchgrid.sweeps.registry import SWEEP_KINDS, row_shapes
from patchgrid.warehouse.agreement import agreement
from patchgrid.warehouse.loader import connect, load_run, query, start_run
from tests.support.effect_rows import (
    CLEAN,
    CORRUPT,
    atp_row,
    baseline,
    between,
    make_pair,
    row,
    shifted,
    write_and_read_back,
)

ROLES = ("subject_first", "subject_last", "further", "last")
N_PAIRS, N_LAYERS, TOP_K, RANDOM_R = 10, 12, 3, 5


def pair_record(pid):
    return {"pair_id": pid, "relation": "r", "status": "accepted", "clean_prompt": f"c{pid}",
            "corrupt_prompt": f"x{pid}", "roles": list(ROLES), "subject_start": 0, "subject_end": 2}


def load(tmp_path, rows, pair_ids, name="w"):
    wh = tmp_path / f"{name}.duckdb"
    f, stored = write_and_read_back(rows, tmp_path / f"{name}.parquet")
    start_run(wh, {"run_id": "r", "model": "m"})
    load_run(wh, "r", pairs_table([pair_record(p) for p in pair_ids]), [], [f], sweep_kinds=row_shapes())
    return wh, stored


def screened(seed=5):
    """Ten pairs of 48 resid sites at one position each (12 layers x 4 positions) on logprob_diff:
    estimates near the truth, rounded to 0.1 so that ties occur; the top 3 by |estimate| and a seeded 5
    of the others verified."""
    rng = random.Random(seed)
    rows, ids = [], [f"p{i}" for i in range(N_PAIRS)]
    for pid in ids:
        pair = make_pair(pid, ROLES, subject=(0, 2))
        sites = [(layer, pos) for layer in range(N_LAYERS) for pos in range(len(ROLES))]
        truth = {s: rng.uniform(-0.3, 0.3) if rng.random() < 0.4 else rng.uniform(-0.05, 0.05) for s in sites}
        estimate = {s: round(truth[s] * 5 * rng.uniform(0.3, 1.7) + rng.gauss(0, 0.3), 1) for s in sites}
        top = sorted(sites, key=lambda s: -abs(estimate[s]))[:TOP_K]
        sample = rng.sample([s for s in sites if s not in top], RANDOM_R)
        for s in sites:
            verify = "top" if s in top else "random" if s in sample else None
            rows.append(atp_row(pair, estimate[s], layer=s[0], position=s[1], verify=verify,
                                r=truth[s] if verify else None, metric="logprob_diff"))
    return rows, ids


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    rows, ids = screened()
    return load(tmp_path_factory.mktemp("agreement"), rows, ids)


def _agreement(wh, **kw):
    con = connect(wh)
    try:
        return agreement(con, "r", **kw)
    finally:
        con.close()


def test_correlations_are_over_the_random_rows_alone(study):
    wh, stored = study
    (a,) = _agreement(wh)
    rand = [r for r in stored if r["verify"] == "random"]
    xs = np.array([r["estimate"] for r in rand], dtype=float)
    ys = np.array([r["effect"] for r in rand], dtype=float)
    assert len(set(xs)) < len(xs)  # ties among the estimates: Spearman's average ranks matter
    assert (a["site"], a["scope"], a["metric"], a["n_random_verified"], a["n_pairs_random"]) == (
        "resid", "per_position", "logprob_diff", N_PAIRS * RANDOM_R, N_PAIRS)
    assert a["pearson_random"] == pytest.approx(np.corrcoef(xs, ys)[0, 1], rel=1e-9)
    rho = pd.Series(xs).rank(method="average").corr(pd.Series(ys).rank(method="average"))
    assert a["spearman_random"] == pytest.approx(rho, rel=1e-9)
    # the view's figures are the module's
    (view,) = query(wh, "SELECT pearson_random, spearman_random, pearson_pooled FROM atp_agreement")[1]
    assert view == pytest.approx((a["pearson_random"], a["spearman_random"], a["pearson_pooled"]), rel=1e-12)
    verified = [r for r in stored if r["verify"] is not None]
    pooled = np.corrcoef([r["estimate"] for r in verified], [r["effect"] for r in verified])[0, 1]
    assert a["pearson_pooled"] == pytest.approx(pooled, rel=1e-9)


def _bootstrap(units, figure, resamples, seed):
    """Percentile interval of `figure` over resamples of the units (pairs) with replacement."""
    rng = np.random.default_rng(seed)
    got = []
    for _ in range(resamples):
        drawn = [units[i] for i in rng.integers(0, len(units), len(units))]
        value = figure(drawn)
        if value is not None and not np.isnan(value):
            got.append(value)
    return np.percentile(got, [2.5, 97.5])


def test_bootstrap_intervals_resample_pairs(study):
    wh, stored = study
    (a,) = _agreement(wh, resamples=4000)
    (again,) = _agreement(wh, resamples=4000)
    intervals = [k for k in a if "_ci95_" in k]
    assert len(intervals) == 10 and [again[k] for k in intervals] == [a[k] for k in intervals]  # seeded
    (other,) = _agreement(wh, resamples=4000, seed=1)
    assert other["pearson_random_ci95_low"] != a["pearson_random_ci95_low"] and a["resamples"] == 4000
    for name in ("pearson_random", "spearman_random", "missed_share"):
        assert a[f"{name}_ci95_low"] <= a[name] <= a[f"{name}_ci95_high"], name
        assert a[f"{name}_ci95_low"] < a[f"{name}_ci95_high"], name
    # an independent bootstrap over pairs agrees within its Monte Carlo error; one over rows would be narrower
    by_pair = {}
    for r in stored:
        if r["verify"] == "random":
            by_pair.setdefault(r["pair_id"], []).append((r["estimate"], r["effect"]))
    units = list(by_pair.values())

    def pearson(drawn):
        pts = np.array([p for u in drawn for p in u], dtype=float)
        return np.corrcoef(pts[:, 0], pts[:, 1])[0, 1]

    low, high = _bootstrap(units, pearson, 4000, 11)
    assert a["pearson_random_ci95_low"] == pytest.approx(low, abs=0.03)
    assert a["pearson_random_ci95_high"] == pytest.approx(high, abs=0.03)
    # missed_share's: the ratio sum(outside) / sum(outside + inside) of the pairs drawn, from its
    # definition: outside = R_hi / R x (N - T), inside = T_hi, important: |recovery| >= 0.1
    parts = []
    for pid in by_pair:
        rs = [r for r in stored if r["pair_id"] == pid]
        hi = [r for r in rs if r["recovery"] is not None and abs(r["recovery"]) >= 0.1]
        n_top = sum(r["verify"] == "top" for r in rs)
        parts.append((sum(r["verify"] == "random" for r in hi) / RANDOM_R * (len(rs) - n_top),
                      sum(r["verify"] == "top" for r in hi)))
    share = sum(o for o, _ in parts) / sum(o + i for o, i in parts)
    assert a["missed_share"] == pytest.approx(share, rel=1e-9)
    low, high = _bootstrap(parts, lambda d: sum(o for o, _ in d) / sum(o + i for o, i in d), 4000, 12)
    assert (a["missed_share_ci95_low"], a["missed_share_ci95_high"]) == (pytest.approx(low, abs=0.03),
                                                                         pytest.approx(high, abs=0.03))


def test_the_span_guard_leaves_a_degenerate_pair_out_of_missed_share(tmp_path):
    """Two pairs of ten sites, the top 2 and 4 random verified, the same recoveries. p1's clean and
    corrupt runs are 0.2 apart on logprob_diff (its min_span is 0.5): its recoveries are ratios of
    noise, so it is counted as unguarded and left out; missed_share is p0's alone."""
    recoveries = [0.9, 0.05, 0.5, 0.02, 0.3, 0.01, 0, 0, 0, 0]  # sites 0-1 top, 2-5 random
    verify = ["top", "top", "random", "random", "random", "random"] + [None] * 4
    rows = []
    close = (shifted(CLEAN, logprob_diff=0.1), shifted(CORRUPT, logprob_diff=-0.1))
    for pid, (clean, corrupt) in {"p0": (CLEAN, CORRUPT), "p1": close}.items():
        pair = make_pair(pid, ROLES, subject=(0, 2))
        for layer, (r, v) in enumerate(zip(recoveries, verify)):
            rows.append(atp_row(pair, 1.0 - layer / 10, layer=layer, position=0, verify=v, r=r if v else None,
                                metric="logprob_diff", clean=clean, corrupt=corrupt))
    wh, _ = load(tmp_path, rows, ["p0", "p1"])
    (a,) = _agreement(wh)
    # p0: important top 1 (site 0), random 2 of 4 (sites 2, 4): outside = 2/4 x 8 = 4, inside 1
    assert (a["n_pairs"], a["n_pairs_unguarded"], a["n_pairs_missed"]) == (2, 1, 1)
    assert a["missed_share"] == pytest.approx(4 / 5)
    assert a["missed_share_ci95_low"] is None  # one pair enters: no interval
    pairs = dict(query(wh, "SELECT pair_id, span_ok FROM atp_agreement_pairs")[1])
    assert pairs == {"p0": True, "p1": False}


def test_the_top_k_and_sample_are_taken_per_site_and_scope():
    """Heads at every position at once and at two roles' positions: each scope its own top K by
    |estimate| and its own sample, and count() the runs that makes."""
    atp = SWEEP_KINDS["atp"]
    config = SweepConfig(sweeps=("atp",), atp_kinds=("heads",), verify_top=2, verify_random=3)
    ctx = SweepContext(config=config, n_layers=3, n_heads=4)
    pair = make_pair("p0", ROLES, subject=(0, 2))
    cells = atp.grid(pair, ctx)
    assert {c.position for c in cells} == {None, ROLES.index("subject_last"), ROLES.index("last")}
    rng = random.Random(1)
    # the every-position cells' estimates are all larger: one top K over both would take only them
    scores = {c: (rng.uniform(5, 9) if c.position is None else rng.uniform(0, 1), None) for c in cells}
    chosen = atp.verified(pair, scores, config)
    for every in (True, False):
        group = [c for c in cells if (c.position is None) == every]
        top = sorted(group, key=lambda c: -scores[c][0])[:2]
        assert {c for c in group if chosen.get(c) == "top"} == set(top)
        assert sum(chosen.get(c) == "random" for c in group) == 3
    assert len(chosen) == atp.count(pair, ctx) == 2 * (2 + 3)


def _multi_token_pair(pid):
    return Pair(pid, "r", tuple(range(4)), tuple(range(4)), (1, 5), (2,), 0, 2, ROLES)


def test_every_atp_row_is_on_logprob_diff_so_both_summaries_cover_the_same_pairs(tmp_path):
    """The atp sweep's rows of a one-token pair and of a pair whose answers are scored whole are both
    on logprob_diff (the AtP objective); atp_summary and effect_summary on it hold the same pairs."""
    atp = SWEEP_KINDS["atp"]
    config = SweepConfig(sweeps=("atp",), atp_kinds=("resid",), verify_top=1, verify_random=1)
    ctx = SweepContext(config=config, n_layers=2, n_heads=2)
    multi_clean, multi_corrupt = shifted(CLEAN, logit_diff=None), shifted(CORRUPT, logit_diff=None)
    rows = []
    for pair, clean, corrupt in ((make_pair("one", ROLES, subject=(0, 2)), CLEAN, CORRUPT),
                                 (_multi_token_pair("whole"), multi_clean, multi_corrupt)):
        cells = atp.grid(pair, ctx)
        estimates = {c: (0.1 * k, None) for k, c in enumerate(cells)}
        chosen = atp.verified(pair, estimates, config)
        prepared = ctx.with_prepared("atp", {pair.pair_id: {c: (e, g, chosen.get(c)) for c, (e, g) in
                                                           estimates.items()}})
        readings = [(c, between(0.5, clean, corrupt)) for c in cells if c in chosen]
        rows += atp.rows(pair, readings, baseline(pair.pair_id, clean, corrupt), prepared)
        # the exact resid sweep's rows, on that kind's own headline metric
        metric = SWEEP_KINDS["resid"].headline(pair)
        rows += [row(pair, 0.5, layer=c.layer, position=c.position, metric=metric, clean=clean, corrupt=corrupt)
                 for c in cells]
    assert {r["metric"] for r in rows if r["sweep"] == "atp"} == {"logprob_diff"}
    assert {r["metric"] for r in rows if r["sweep"] == "resid"} == {"logit_diff", "logprob_diff"}
    wh, _ = load(tmp_path, rows, ["one", "whole"])
    atp_pairs = query(wh, "SELECT DISTINCT metric, pair_id FROM atp_pair_estimates ORDER BY ALL")[1]
    exact_pairs = query(wh, "SELECT DISTINCT metric, pair_id FROM pair_effects WHERE metric = 'logprob_diff' "
                            "ORDER BY ALL")[1]
    assert atp_pairs == exact_pairs == [("logprob_diff", "one"), ("logprob_diff", "whole")]
    (n_atp,), (n_exact,) = (query(wh, f"SELECT DISTINCT n_pairs FROM {v} WHERE metric = 'logprob_diff'")[1]
                            for v in ("atp_summary", "effect_summary"))
    assert n_atp == n_exact == (2,)
