"""The summary views on hand-built rows: t intervals, the span filter, the ratio of means, and causal
tracing averaged in Meng et al.'s token buckets (the fact-clustered interval: test_fact_clustered_interval.py)."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from patchgrid.metrics import METRICS, Reading, recovery
from patchgrid.pairs import to_table as pairs_table
from patchgrid.rows.effects import write_effects
from patchgrid.sweeps.registry import row_shapes
from patchgrid.warehouse.loader import load_run, query, start_run
from tests.support.effect_rows import CLEAN, CORRUPT, between, make_pair, row, shifted, write_and_read_back


def pair(pid, clean="c", corrupt="x", roles=("subject_last", "last"), start=0, end=1):
    return {"pair_id": pid, "relation": "r", "status": "accepted", "clean_prompt": clean, "corrupt_prompt": corrupt,
            "roles": list(roles), "subject_start": start, "subject_end": end}


def effect(pid, recovery, *, span=4.0, roles=("subject_last", "last"), position=1, sweep="resid", site="resid",
           metric="logit_diff", layer=0, p=None, noised_p=None):
    """A row `recovery` of the way from corrupt to clean, on a logit-difference span of `span`;
    with `p`: a trace row restoring p(answer) to `p` from `noised_p` (every other metric as noised)."""
    clean, corrupt = shifted(CLEAN, logit_diff=CORRUPT.logit_diff + span), CORRUPT
    patched = None
    if p is not None:
        clean, corrupt = shifted(clean, p=0.9), shifted(corrupt, p=noised_p)
        patched = shifted(between(0.0, clean, corrupt), p=p)
    return row(make_pair(pid, roles), recovery, sweep=sweep, site=site, layer=layer, position=position,
               metric=metric, clean=clean, corrupt=corrupt, patched=patched)


def warehouse(tmp_path, pairs, effects):
    wh = tmp_path / "w.duckdb"
    start_run(wh, {"run_id": "r", "model": "m"})
    load_run(wh, "r", pairs_table(pairs), [], [write_effects(effects, tmp_path / "e.parquet")],
             sweep_kinds=row_shapes())
    return wh


def summary(wh, columns, view="effect_summary", metric="logit_diff"):
    cols, rows = query(wh, f"SELECT {columns} FROM {view} WHERE metric = ?", [metric])
    assert len(rows) == 1
    return dict(zip(cols, rows[0]))


def test_student_t_interval_on_three_pairs(tmp_path):
    values = [0.0, 0.5, 1.0]
    wh = warehouse(tmp_path, [pair(f"p{i}", clean=f"c{i}", corrupt=f"x{i}") for i in range(3)],
                   [effect(f"p{i}", v) for i, v in enumerate(values)])
    s = summary(wh, "*")
    se = statistics.stdev(values) / math.sqrt(3)
    assert s["n_pairs"] == s["n_recovery"] == 3 and s["metric"] == "logit_diff"
    assert s["ci95_low"] == pytest.approx(0.5 - 4.3027 * se, abs=1e-4)  # t(0.975, 2), not 1.96
    assert s["ci95_high"] == pytest.approx(0.5 + 4.3027 * se, abs=1e-4)
    # six distinct facts; effect_summary_facts carries the simple interval beside its own
    f = summary(wh, "*", "effect_summary_facts")
    assert f["n_facts"] == 6 and (f["ci95_low"], f["ci95_high"]) == (s["ci95_low"], s["ci95_high"])


@pytest.mark.parametrize("df, t", [(1, 12.7062), (4, 2.7764), (10, 2.2281), (30, 2.0423), (120, 1.9799), (10**6, 1.96)])
def test_t_quantiles(tmp_path, df, t):
    wh = warehouse(tmp_path, [pair("p0")], [effect("p0", 0.5)])
    assert query(wh, "SELECT t975(?)", [df])[1][0][0] == pytest.approx(t, abs=2e-4)


def test_small_spans_are_left_out_of_recovery_and_counted(tmp_path):
    small = METRICS["logit_diff"].min_span / 5
    pairs = [pair(f"p{i}", clean=f"c{i}", corrupt=f"x{i}") for i in range(4)]
    effects = [effect("p0", 0.2), effect("p1", 0.4), effect("p2", 0.6, span=2.0),
               effect("p3", 25.0, span=small)]  # a tiny span makes a wild ratio
    s = summary(warehouse(tmp_path, pairs, effects), "*")
    assert (s["n_pairs"], s["n_recovery"], s["n_small_span"]) == (4, 3, 1)
    assert s["mean_recovery"] == pytest.approx(0.4)
    # ratio of means: sum(patched - corrupt) / sum(clean - corrupt) over the same three pairs
    assert s["ratio_of_means"] == pytest.approx((0.2 * 4 + 0.4 * 4 + 0.6 * 2) / (4 + 4 + 2))
    # the effect is averaged over every pair
    assert s["mean_effect"] == pytest.approx(statistics.mean([0.8, 1.6, 1.2, 25.0 * small]), rel=1e-5)


def test_trace_buckets_average_as_meng_et_al(tmp_path):
    """A one-token subject counts as first and last subject token; further tokens weigh per token;
    the indirect effect is p restored - p noised, not divided."""
    pairs = [pair("one", clean="c1", roles=("subject_last", "after_subject", "further", "further", "last")),
             pair("two", clean="c2", roles=("before_subject", "subject_first", "subject_last", "further", "last"),
                  start=1, end=3)]
    rows = []
    for pid, roles, ps in (("one", pairs[0]["roles"], [0.5, 0.3, 0.2, 0.4, 0.6]),
                           ("two", pairs[1]["roles"], [0.1, 0.3, 0.7, 0.2, 0.5])):
        for pos, p in enumerate(ps):
            rows.append(effect(pid, 0, roles=roles, position=pos, sweep="trace", metric="p", p=p, noised_p=0.1))
    wh = warehouse(tmp_path, pairs, rows)
    got = {b: (n_prompts, n_tokens, aie) for b, n_prompts, n_tokens, aie in query(
        wh, "SELECT bucket, n_prompts, n_tokens, aie FROM trace_buckets WHERE site = 'resid' AND metric = 'p'")[1]}
    assert got["first_subject"] == (2, 2, pytest.approx(((0.5 - 0.1) + (0.3 - 0.1)) / 2))
    assert got["last_subject"] == (2, 2, pytest.approx(((0.5 - 0.1) + (0.7 - 0.1)) / 2))
    assert got["first_subsequent"] == (1, 1, pytest.approx(0.3 - 0.1))
    assert got["further"] == (2, 3, pytest.approx(((0.2 - 0.1) + (0.4 - 0.1) + (0.2 - 0.1)) / 3))
    assert got["last"] == (2, 2, pytest.approx(((0.6 - 0.1) + (0.5 - 0.1)) / 2))
    assert "middle_subject" not in got and None not in got  # before_subject is left out
    # every metric is traced; restoring left each one but p where the noised run had it
    assert {m for (m,) in query(wh, "SELECT DISTINCT metric FROM trace_buckets")[1]} == set(METRICS)
    assert query(wh, "SELECT max(abs(aie)) FROM trace_buckets WHERE metric <> 'p'")[1] == [(0.0,)]
    restored = query(wh, "SELECT mean_restored, mean_noised FROM trace_buckets WHERE metric = 'p' AND bucket = 'last'")
    assert restored[1] == [(pytest.approx((0.6 + 0.5) / 2), pytest.approx(0.1))]


def _python_summary(rows, metric):
    """effect_summary's cell on `metric`, computed from the rows with patchgrid.metrics: each pair's
    rows averaged, effects from the run the patch went into, recoveries of pairs whose span in the
    metric's direction reaches min_span."""
    m = METRICS[metric]
    per_pair = {}
    for r in rows:
        patched, clean, corrupt = (r[f"{k}_{metric}"] for k in ("patched", "clean", "corrupt"))
        if patched is None:
            continue
        reference = clean if r["direction"] == "noise" else corrupt
        per_pair.setdefault(r["pair_id"], []).append(
            (patched - reference, recovery(patched, clean, corrupt), patched - corrupt, clean - corrupt))
    pairs = [[statistics.mean(col) for col in zip(*v)] for v in per_pair.values()]
    kept = [p for p in pairs if m.min_span is not None and m.better * p[3] >= m.min_span]
    return {"n_pairs": len(pairs), "mean_effect": statistics.mean(p[0] for p in pairs),
            "n_recovery": len(kept), "mean_recovery": statistics.mean(p[1] for p in kept) if kept else None,
            "ratio_of_means": sum(p[2] for p in kept) / sum(p[3] for p in kept) if kept else None}


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_every_metric_has_its_own_mean_effect_and_recovery(tmp_path, direction):
    """Six pairs with their own baselines and readings on every metric (two `further` rows each):
    each metric's cell equals the computation with patchgrid.metrics on the same float32 rows."""
    rng = random.Random(7)
    roles = ("subject_last", "further", "further", "last")
    rows = []
    for i in range(6):
        clean = Reading(rng.uniform(1, 4), rng.uniform(1, 4), rng.uniform(-1, -0.1), rng.uniform(-6, -3),
                        rng.uniform(0.3, 0.9), 0.0, float(rng.randrange(2)))
        corrupt = Reading(rng.uniform(-4, -1), rng.uniform(-4, -1), rng.uniform(-6, -3), rng.uniform(-1, -0.1),
                          rng.uniform(0.0, 0.1), rng.uniform(0.5, 3), float(rng.randrange(3, 9)))
        if i == 5:  # a multi-token answer: no logit difference; and a KL span too small to divide by
            clean, corrupt = shifted(clean, logit_diff=None), shifted(corrupt, logit_diff=None, kl=0.05)
        for position in (1, 2):
            patched = Reading(**{name: None if clean.value(name) is None else rng.uniform(-6, 6) for name in METRICS})
            rows.append(row(make_pair(f"p{i}", roles), 0, direction=direction, position=position, clean=clean,
                            corrupt=corrupt, patched=patched))
    f, stored = write_and_read_back(rows, tmp_path / "e.parquet")
    wh = tmp_path / "w.duckdb"
    start_run(wh, {"run_id": "r", "model": "m"})
    load_run(wh, "r", pairs_table([pair(f"p{i}", roles=roles) for i in range(6)]), [], [f], sweep_kinds=row_shapes())
    cols, got = query(wh, "SELECT metric, n_pairs, n_recovery, mean_effect, mean_recovery, ratio_of_means "
                          "FROM effect_summary")
    got = {r[0]: dict(zip(cols[1:], r[1:])) for r in got}
    assert set(got) == set(METRICS)
    for metric in METRICS:
        want = _python_summary(stored, metric)
        assert got[metric] == {k: pytest.approx(v, rel=1e-9, abs=1e-12) if v is not None else None
                               for k, v in want.items()}, metric
    assert got["logit_diff"]["n_pairs"] == 5 and got["kl"]["n_recovery"] == 5
    # the metrics differ, so no metric's numbers stand in for another's
    assert len({round(g["mean_effect"], 6) for g in got.values()}) == len(METRICS)


def test_span_is_judged_in_the_metrics_direction(tmp_path):
    """kl and logp_corrupt are smaller on the clean run (better -1): their spans clean - corrupt are
    negative, and a pair is kept when -span reaches min_span; a span the wrong way round is not."""
    roles = ("subject_last", "last")
    wide = row(make_pair("wide", roles), 0.5, position=1)  # CORRUPT: kl 2, logp_corrupt -0.5 (clean: 0, -3)
    narrow = row(make_pair("narrow", roles), 0.5, position=1, corrupt=shifted(CORRUPT, kl=0.05))
    wrong = row(make_pair("wrong", roles), 0.5, position=1, corrupt=shifted(CORRUPT, logp_corrupt=-3.5))
    wh = warehouse(tmp_path, [pair(p, clean=p, corrupt=p + "x") for p in ("wide", "narrow", "wrong")],
                   [wide, narrow, wrong])
    judged = dict(((m, p), ok) for m, p, ok in query(
        wh, "SELECT metric, pair_id, span_ok FROM pair_effects_judged WHERE metric IN ('kl', 'logp_corrupt')")[1])
    assert judged == {("kl", "wide"): True, ("kl", "narrow"): False, ("kl", "wrong"): True,
                      ("logp_corrupt", "wide"): True, ("logp_corrupt", "narrow"): True,
                      ("logp_corrupt", "wrong"): False}
    for metric in ("kl", "logp_corrupt"):
        s = summary(wh, "n_pairs, n_recovery, n_small_span, mean_recovery", metric=metric)
        assert (s["n_pairs"], s["n_recovery"], s["n_small_span"]) == (3, 2, 1)
        assert s["mean_recovery"] == pytest.approx(0.5)
    # kl's recovery is 1 - KL(patched) / KL(corrupt): half way from KL 2 to 0 is 1, recovery 0.5
    assert query(wh, "SELECT patched, recovery FROM effect_metrics WHERE metric = 'kl' AND pair_id = 'wide'")[1] == [
        (pytest.approx(1.0), pytest.approx(0.5))]


def test_rank_has_no_recovery(tmp_path):
    wh = warehouse(tmp_path, [pair("p0"), pair("p1", clean="c1", corrupt="x1")],
                   [effect("p0", 0.5), effect("p1", 1.0)])
    assert query(wh, "SELECT better, min_span FROM metrics WHERE metric = 'rank'")[1] == [(-1, None)]
    assert query(wh, "SELECT count(*), count(recovery) FROM effect_metrics WHERE metric = 'rank'")[1] == [(2, 0)]
    s = summary(wh, "*", metric="rank")
    # CORRUPT's rank 6, CLEAN's 0: half way is 3 (effect -3), all the way 0 (effect -6)
    assert s["mean_effect"] == pytest.approx(-4.5) and s["n_pairs"] == 2
    assert (s["n_recovery"], s["n_small_span"], s["mean_recovery"], s["ratio_of_means"]) == (0, 0, None, None)
    f = summary(wh, "mean_recovery, ci95_low_facts, effect_ci95_low_facts", "effect_summary_facts", metric="rank")
    assert f["mean_recovery"] is None and f["ci95_low_facts"] is None and f["effect_ci95_low_facts"] is not None
