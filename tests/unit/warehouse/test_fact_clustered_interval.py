"""effect_summary_facts' fact-clustered interval is the dyadic-robust variance of a mean (Aronow, Samii &
Assenova 2015; Cameron & Miller 2014): two pairs are dependent when they share a fact at either end, in
either role. On hand-built warehouses with shared and reciprocal facts, the view's intervals equal
(a) the estimator's definition, a double loop over pairs written here, and (b) statsmodels' cluster-robust
variance of an intercept-only regression: for pairs of two facts, each pair stacked once per fact and
clustered by fact, less the same rows clustered by their unordered fact pair; for pairs of one fact
(causal tracing reads the clean prompt alone), one-way clustering by that fact."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import statsmodels.api as sm
from scipy import stats

from patchgrid.metrics import METRICS
from patchgrid.warehouse.loader import query
from tests.unit.warehouse.test_views import effect, pair, warehouse

# Six facts; A->B and B->A, C->D and D->C are reciprocal; every fact is at the end of several pairs.
FACTS = [("A", "B"), ("B", "A"), ("A", "C"), ("C", "D"), ("D", "C"), ("E", "A"), ("F", "B"), ("B", "E"),
         ("C", "F"), ("D", "E"), ("F", "D"), ("E", "F"), ("A", "D"), ("B", "C")]
SMALL = METRICS["logit_diff"].min_span / 4  # a span below min_span: the pair is out of the recovery columns


def dyadic(values, facts):
    """The definition: G / (G - 1) * (1 / n^2) * sum over the pairs (i, j), i = j included, that share a
    fact of e_i e_j, e_i = y_i - mean, G the facts at the pairs' ends; with t on min(n, G) - 1 degrees
    of freedom."""
    n, mean = len(values), sum(values) / len(values)
    e = [v - mean for v in values]
    g = len(set().union(*map(set, facts)))
    meat = sum(e[i] * e[j] for i in range(n) for j in range(n) if set(facts[i]) & set(facts[j]))
    return g / (g - 1) * meat / n ** 2, min(n, g) - 1


def statsmodels_dyadic(values, facts):
    """statsmodels' cluster-robust variances (no small-sample factor) of an intercept-only OLS: the pairs
    stacked once per fact at their ends and clustered by fact, less the pairs clustered by their
    unordered fact pair where their two facts differ; times G / (G - 1)."""
    def cluster_variance(y, groups):
        codes = np.unique(np.asarray(groups), return_inverse=True)[1]
        fit = sm.OLS(np.asarray(y, dtype=float), np.ones((len(y), 1))).fit(
            cov_type="cluster", cov_kwds={"groups": codes, "use_correction": False})
        return float(fit.cov_params()[0, 0]) * len(y) ** 2  # the meat: sum over groups of (sum of residuals)^2

    stacked = [(v, f) for v, fs in zip(values, facts) for f in dict.fromkeys(fs)]
    assert len(stacked) in (len(values), 2 * len(values))  # every pair stacked as often: one mean
    meat = cluster_variance(*zip(*stacked))
    two = [(v, "|".join(sorted(fs))) for v, fs in zip(values, facts) if len(set(fs)) == 2]
    if two:
        meat -= cluster_variance(*zip(*two))
    g = len({f for _, f in stacked})
    return g / (g - 1) * meat / len(values) ** 2


def half_widths(wh, metric="logit_diff"):
    cols, rows = query(wh, "SELECT * FROM effect_summary_facts WHERE metric = ?", [metric])
    assert len(rows) == 1
    s = dict(zip(cols, rows[0]))
    effect_hw = None if s["effect_ci95_high_facts"] is None else s["effect_ci95_high_facts"] - s["mean_effect"]
    recovery_hw = None if s["ci95_high_facts"] is None else s["ci95_high_facts"] - s["mean_recovery"]
    return s, effect_hw, recovery_hw


def expected_half_width(values, facts):
    var, df = dyadic(values, facts)
    return stats.t.ppf(0.975, df) * math.sqrt(var)


def two_fact_warehouse(tmp_path, facts, recoveries, spans):
    pairs = [pair(f"p{i}", clean=c, corrupt=k) for i, (c, k) in enumerate(facts)]
    return warehouse(tmp_path, pairs, [effect(f"p{i}", r, span=s) for i, (r, s) in
                                       enumerate(zip(recoveries, spans))])


def test_the_interval_is_the_dyadic_estimator(tmp_path):
    """Fourteen pairs on six facts, two reciprocal couples among them; three pairs' spans too small for
    the recovery columns, whose estimator runs over the eleven kept pairs and the facts they touch."""
    rng = random.Random(30)
    recoveries = [rng.uniform(-0.5, 1.5) for _ in FACTS]
    spans = [rng.uniform(2.0, 6.0) for _ in FACTS]
    for i in (2, 7, 11):
        spans[i] = SMALL
    effects = [r * s for r, s in zip(recoveries, spans)]  # effect = patched - corrupt, r of the span
    kept = [i for i, s in enumerate(spans) if s >= METRICS["logit_diff"].min_span]
    s, effect_hw, recovery_hw = half_widths(two_fact_warehouse(tmp_path, FACTS, recoveries, spans))
    assert (s["n_pairs"], s["n_facts"], s["n_recovery"], s["n_facts_recovery"]) == (14, 6, 11, 6)
    assert s["mean_effect"] == pytest.approx(np.mean(effects), rel=1e-6)
    # (a) the definition, (b) statsmodels: the same variance, and the view's t on G - 1 = 5 df
    for values, facts, got in ((effects, FACTS, effect_hw),
                               ([recoveries[i] for i in kept], [FACTS[i] for i in kept], recovery_hw)):
        var, df = dyadic(values, facts)
        assert df == 5 and var > 0
        assert statsmodels_dyadic(values, facts) == pytest.approx(var, rel=1e-9)
        assert got == pytest.approx(expected_half_width(values, facts), rel=2e-4)
    # a reciprocal pair's cross term counts once: counting it at both its facts gives another width
    n, mean = len(effects), np.mean(effects)
    e = [v - mean for v in effects]
    twice = sum(e[i] * e[j] * len(set(FACTS[i]) & set(FACTS[j])) for i in range(n) for j in range(n))
    assert math.sqrt(6 / 5 * twice / n ** 2) * stats.t.ppf(0.975, 5) != pytest.approx(effect_hw, rel=1e-2)


def test_pairs_on_disjoint_facts(tmp_path):
    """No two pairs share a fact: the variance is G / (G - 1) * sum e_i^2 / n^2 with G = 2n facts, and t
    has n - 1 degrees of freedom (n residuals summing to zero carry no more), not G - 1."""
    facts = [(f"c{i}", f"x{i}") for i in range(4)]
    recoveries = [0.1, 0.5, 0.2, 0.9]
    s, effect_hw, recovery_hw = half_widths(two_fact_warehouse(tmp_path, facts, recoveries, [4.0] * 4))
    assert (s["n_pairs"], s["n_facts"]) == (4, 8)
    e = np.array(recoveries) - np.mean(recoveries)
    assert dyadic(recoveries, facts) == (pytest.approx(8 / 7 * (e ** 2).sum() / 16), 3)
    assert statsmodels_dyadic(recoveries, facts) == pytest.approx(8 / 7 * (e ** 2).sum() / 16)
    assert recovery_hw == pytest.approx(expected_half_width(recoveries, facts), rel=2e-4)
    assert effect_hw == pytest.approx(4.0 * recovery_hw, rel=1e-5)


def test_pairs_of_one_fact_are_clustered_by_it(tmp_path):
    """Causal tracing's rows stand on the clean prompt alone: the estimator is one-way clustering by
    fact with the CR1 factor G / (G - 1), statsmodels' own interval (t on G - 1 degrees of freedom)."""
    clean = ["A", "A", "B", "B", "B", "C", "D", "D", "E"]
    ps = [0.35, 0.42, 0.8, 0.72, 0.9, 0.15, 0.5, 0.61, 0.3]
    pairs = [pair(f"p{i}", clean=c, corrupt=f"x{i}") for i, c in enumerate(clean)]
    rows = [effect(f"p{i}", 0, sweep="trace", metric="p", p=p, noised_p=0.1) for i, p in enumerate(ps)]
    s, effect_hw, _ = half_widths(warehouse(tmp_path, pairs, rows), metric="p")
    assert (s["n_pairs"], s["n_facts"]) == (9, 5)
    y = np.array(ps) - 0.1  # p restored - p noised
    fit = sm.OLS(y, np.ones((9, 1))).fit(cov_type="cluster", use_t=True,
                                         cov_kwds={"groups": np.unique(clean, return_inverse=True)[1]})
    low, high = fit.conf_int()[0]
    assert (s["effect_ci95_low_facts"], s["effect_ci95_high_facts"]) == pytest.approx((low, high), rel=2e-4)
    assert effect_hw == pytest.approx(expected_half_width(list(y), [(c,) for c in clean]), rel=2e-4)


@pytest.mark.parametrize("facts, recoveries", [
    # every pair shares a fact with every other: the estimate is 0
    ([("A", "B")] * 3 + [("B", "A")] * 3, [0.9, 0.92, 0.88, 0.1, 0.12, 0.08]),
    # a cycle of four facts, neighbours alternating: the estimate is negative
    ([("A", "B"), ("B", "C"), ("C", "D"), ("D", "A")], [1.0, 0.0, 1.0, 0.0]),
])
def test_no_interval_where_the_estimate_is_not_positive(tmp_path, facts, recoveries):
    """No floor: where the estimator is not positive the view gives no interval, and the simple one stays."""
    var, _ = dyadic(recoveries, facts)
    assert var < 1e-15 and statsmodels_dyadic(recoveries, facts) < 1e-15
    s, effect_hw, recovery_hw = half_widths(two_fact_warehouse(tmp_path, facts, recoveries, [4.0] * len(facts)))
    assert effect_hw is None and recovery_hw is None and s["effect_ci95_low_facts"] is None
    assert s["ci95_low"] < s["mean_recovery"] < s["ci95_high"]
