"""Path patching and the new site kinds in the warehouse: path_summary and path_matrix against a
computation by hand on the stored rows, every summary view keeping one sender's receivers apart,
and resid_pre / resid_mid / qkv rows summarised as resid / heads rows are."""
from __future__ import annotations

import math
import random
import statistics

import pytest

from patchgrid.metrics import METRICS
from patchgrid.pairs import to_table as pairs_table
from patchgrid.sweeps.registry import row_shapes
from patchgrid.warehouse.loader import load_run, query, start_run
from tests.support.effect_rows import CLEAN, CORRUPT, make_pair, row, shifted, write_and_read_back

ROLES = ("subject_first", "subject_last", "further", "last")
N_PAIRS = 5
T975 = [None, 12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622]
# (site, layer, head) of each sender, and its receivers: the logits, and head 0 of layer 2's inputs
# (k and v by key/value head 0); layer-2 senders reach the logits only
SENDERS = [("head", 0, 0), ("head", 0, 1), ("attn_out", 0, None), ("mlp_out", 0, None), ("head", 1, 3),
           ("mlp_out", 2, None)]
RECEIVERS = ("logits", "q.2.0", "k.2.0", "v.2.0")


def sender_name(site, layer, head):
    return f"{site}.{layer}" if head is None else f"{site}.{layer}.{head}"


def receivers(layer):
    return [r for r in RECEIVERS if r == "logits" or int(r.split(".")[1]) > layer]


def pair_record(pid):
    return {"pair_id": pid, "relation": "r", "status": "accepted", "clean_prompt": f"c{pid}",
            "corrupt_prompt": f"x{pid}", "roles": list(ROLES), "subject_start": 0, "subject_end": 2}


def baselines(i):
    """Each pair its own clean run, so that effects and recoveries spread over pairs."""
    return shifted(CLEAN, logit_diff=2.0 + i / 3), CORRUPT


def path_rows(seed=7):
    """Paths rows of N_PAIRS pairs: every sender to each of its receivers, at every position at once
    and at the last position, each path its own recovery (the receivers of one sender differ)."""
    rng = random.Random(seed)
    out = []
    for i in range(N_PAIRS):
        pair = make_pair(f"p{i}", ROLES, subject=(0, 2))
        clean, corrupt = baselines(i)
        for k, (site, layer, head) in enumerate(SENDERS):
            for j, receiver in enumerate(receivers(layer)):
                for position in (None, len(ROLES) - 1):
                    r = 0.1 * k - 0.2 * j + (0.05 if position is None else 0.0) + rng.uniform(-0.1, 0.1)
                    out.append(row(pair, r, sweep="paths", site=site, layer=layer, position=position, head=head,
                                   receiver=receiver, clean=clean, corrupt=corrupt))
    return out


def load(tmp_path, rows, run_id="r", params=None):
    wh = tmp_path / "w.duckdb"
    f, stored = write_and_read_back(rows, tmp_path / f"{run_id}.parquet")
    start_run(wh, {"run_id": run_id, "model": "m", "params": params or {}})
    load_run(wh, run_id, pairs_table([pair_record(f"p{i}") for i in range(N_PAIRS)]), [], [f],
             sweep_kinds=row_shapes())
    return wh, stored


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    return load(tmp_path_factory.mktemp("paths"), path_rows(),
                params={"path_senders": ["heads"], "path_receivers": ["logits", "heads"],
                        "path_inputs": ["q", "k", "v"], "path_mlps": "frozen"})


def _rows(wh, sql, params=None):
    cols, rows = query(wh, sql, params)
    return [dict(zip(cols, r)) for r in rows]


def _interval(values):
    n = len(values)
    mean = statistics.mean(values)
    if n < 2:
        return mean, None, None
    half = T975[n - 1] * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def test_path_rows_name_both_ends(study):
    _, stored = study
    assert {r["sender"] for r in stored} == {sender_name(*s) for s in SENDERS}
    assert {r["receiver"] for r in stored} == set(RECEIVERS)
    assert {r["position_role"] for r in stored} == {"all", "last"}


def test_path_summary_matches_a_hand_computation(study):
    """Per (sender, receiver, role): the mean over pairs of patched - corrupt on logit_diff, its
    t interval (t975 on n - 1, as effect_summary), and the mean recovery with its interval."""
    wh, stored = study
    cells = {}
    for r in stored:
        cells.setdefault((r["sender"], r["receiver"], r["position_role"]), []).append(r)
    got = {(s["sender"], s["receiver"], s["position_role"]): s for s in _rows(
        wh, "SELECT * FROM path_summary WHERE run_id = 'r' AND metric = 'logit_diff'")}
    assert set(got) == set(cells)
    for key, rows in cells.items():
        effects = [r["patched_logit_diff"] - r["corrupt_logit_diff"] for r in rows]
        recoveries = [(r["patched_logit_diff"] - r["corrupt_logit_diff"]) / (r["clean_logit_diff"]
                                                                             - r["corrupt_logit_diff"]) for r in rows]
        s = got[key]
        mean, lo, hi = _interval(effects)
        assert s["n_pairs"] == N_PAIRS == len(rows), key
        assert (s["mean_effect"], s["effect_ci95_low"], s["effect_ci95_high"]) == pytest.approx(
            (mean, lo, hi), rel=1e-9, abs=1e-5), key
        mean, lo, hi = _interval(recoveries)
        assert s["n_recovery"] == N_PAIRS
        assert (s["mean_recovery"], s["ci95_low"], s["ci95_high"]) == pytest.approx((mean, lo, hi), rel=1e-9,
                                                                                    abs=1e-5), key
    # one worked by hand in full: five pairs, t on 4 degrees of freedom
    rows = cells[("head.0.0", "q.2.0", "all")]
    effects = [r["patched_logit_diff"] - r["corrupt_logit_diff"] for r in rows]
    m = sum(effects) / 5
    sd = math.sqrt(sum((e - m) ** 2 for e in effects) / 4)
    s = got[("head.0.0", "q.2.0", "all")]
    assert s["effect_ci95_low"] == pytest.approx(m - 2.7764 * sd / math.sqrt(5), abs=1e-6)
    assert s["effect_ci95_high"] == pytest.approx(m + 2.7764 * sd / math.sqrt(5), abs=1e-6)


def test_path_summary_is_the_effect_summary_of_paths(study):
    """The same numbers as effect_summary's paths cells (the interval defined once), on every metric."""
    wh, _ = study
    # DuckDB sums floats in parallel, in no fixed order: two evaluations agree to rounding, not bit for bit
    close = " OR ".join(f"NOT (p.{c} IS NULL AND e.{c} IS NULL OR abs(p.{c} - e.{c}) <= 1e-9)"
                        for c in ("mean_effect", "effect_ci95_low", "effect_ci95_high", "mean_recovery", "ci95_low",
                                  "ci95_high"))
    diff = query(wh, f"""
        SELECT count(*) FROM path_summary p JOIN effect_summary e ON e.sweep = 'paths' AND e.run_id = p.run_id
            AND e.metric = p.metric AND e.sender = p.sender AND e.receiver = p.receiver
            AND e.position_role = p.position_role
        WHERE (p.n_pairs, p.n_recovery) IS DISTINCT FROM (e.n_pairs, e.n_recovery) OR {close}
    """)[1]
    assert diff == [(0,)]
    assert query(wh, "SELECT count(*) FROM path_summary")[1] == query(
        wh, "SELECT count(*) FROM effect_summary WHERE sweep = 'paths'")[1]
    assert {m for (m,) in query(wh, "SELECT DISTINCT metric FROM path_summary")[1]} == set(METRICS)
    # rank has no recovery
    assert query(wh, "SELECT count(mean_recovery), sum(n_recovery) FROM path_summary WHERE metric = 'rank'")[1] == [
        (0, 0)]


def test_path_summary_unique_and_not_null(study):
    wh, _ = study
    key = "run_id, metric, sender, receiver, position_role"
    dup = query(wh, f"SELECT count(*) FROM (SELECT {key}, count(*) c FROM path_summary GROUP BY ALL HAVING c > 1)")
    assert dup[1] == [(0,)]
    required = ("run_id", "metric", "sender", "receiver", "position_role", "sender_site", "sender_layer", "n_pairs",
                "mean_effect")
    nulls = " OR ".join(f"{c} IS NULL" for c in required)
    assert query(wh, f"SELECT count(*) FROM path_summary WHERE {nulls}")[1] == [(0,)]
    n_paths = sum(len(receivers(layer)) for _, layer, _ in SENDERS)
    assert query(wh, "SELECT count(*) FROM path_summary WHERE metric = 'logit_diff'")[1] == [(2 * n_paths,)]
    # both ends spelled out: the sender's site, layer and head, the receiver's input, layer and head
    for s in _rows(wh, "SELECT DISTINCT sender, receiver, sender_site, sender_layer, sender_head, receiver_input, "
                       "receiver_layer, receiver_head FROM path_summary"):
        assert sender_name(s["sender_site"], s["sender_layer"], s["sender_head"]) == s["sender"]
        if s["receiver"] == "logits":
            assert (s["receiver_input"], s["receiver_layer"], s["receiver_head"]) == (None, None, None)
        else:
            assert f"{s['receiver_input']}.{s['receiver_layer']}.{s['receiver_head']}" == s["receiver"]
            assert s["receiver_input"] in ("q", "k", "v") and s["receiver_layer"] > s["sender_layer"]


@pytest.mark.parametrize("view, extra", [("effect_summary", ""), ("effect_summary_facts", ""),
                                         ("relation_summary", "relation, ")])
def test_summaries_keep_one_senders_receivers_apart(study, view, extra):
    """head.0.0's paths to the logits and to q, k and v of head 2.0 are four cells of five pairs each,
    not one cell of twenty rows."""
    wh, stored = study
    got = _rows(wh, f"SELECT {extra}sender, receiver, n_pairs, mean_effect FROM {view} WHERE sweep = 'paths' "
                    "AND metric = 'logit_diff' AND site = 'head' AND layer = 0 AND head = 0 AND position_role = 'all'")
    assert sorted(g["receiver"] for g in got) == sorted(RECEIVERS)
    assert all(g["n_pairs"] == N_PAIRS and g["sender"] == "head.0.0" for g in got)
    for g in got:
        want = statistics.mean(r["patched_logit_diff"] - r["corrupt_logit_diff"] for r in stored
                               if (r["sender"], r["receiver"], r["position_role"])
                               == ("head.0.0", g["receiver"], "all"))
        assert g["mean_effect"] == pytest.approx(want, rel=1e-9)
    assert len({round(g["mean_effect"], 6) for g in got}) == len(RECEIVERS)
    key = (f"run_id, {extra}sweep, site, direction, metric, layer, position_role, head, neuron, sender, receiver")
    dup = query(wh, f"SELECT count(*) FROM (SELECT {key}, count(*) c FROM {view} GROUP BY ALL HAVING c > 1)")[1]
    assert dup == [(0,)], view


def test_path_matrix(study):
    from patchgrid.warehouse.queries import path_matrix

    wh, _ = study
    cols, rows = path_matrix(wh, "r")
    got = [dict(zip(cols, r)) for r in rows]
    assert {g["metric"] for g in got} == {"logprob_diff"}  # the default: every pair has it
    from patchgrid.rows.shapes import POSITION_ROLES

    roles = [g["position_role"] for g in got]  # every role, in the pairs' order, `all` last
    assert roles == sorted(roles, key=POSITION_ROLES.index) and set(roles) == {"last", "all"}
    cols, rows = path_matrix(wh, "r", metric="logit_diff", position_role="all")
    got = [dict(zip(cols, r)) for r in rows]
    assert {(g["metric"], g["position_role"]) for g in got} == {("logit_diff", "all")}
    # senders by layer (heads, then attn_out, then mlp_out), receivers logits first, then layer, head, input
    senders = list(dict.fromkeys(g["sender"] for g in got))
    assert senders == ["head.0.0", "head.0.1", "attn_out.0", "mlp_out.0", "head.1.3", "mlp_out.2"]
    for sender in senders:
        assert [g["receiver"] for g in got if g["sender"] == sender] == \
            ["logits", "q.2.0", "k.2.0", "v.2.0"][:1 if sender == "mlp_out.2" else 4]
    summary = {(s["sender"], s["receiver"]): s for s in _rows(
        wh, "SELECT * FROM path_summary WHERE metric = 'logit_diff' AND position_role = 'all'")}
    for g in got:
        s = summary[(g["sender"], g["receiver"])]
        assert g["n_pairs"] == s["n_pairs"] and g["mean_effect"] == pytest.approx(s["mean_effect"], abs=5e-4)
        assert g["effect_ci95_low"] == pytest.approx(s["effect_ci95_low"], abs=5e-4)
    with pytest.raises(ValueError, match="metric 'nope' is not one of"):
        path_matrix(wh, "r", metric="nope")
    assert path_matrix(wh, "r", position_role="subject_first")[1] == []


def test_paths_params_are_in_runs(study):
    wh, _ = study
    assert query(wh, "SELECT params->>'path_mlps' FROM runs WHERE run_id = 'r'")[1] == [("frozen",)]


def test_resid_pre_resid_mid_and_qkv_summarise_like_resid_and_heads(tmp_path):
    """The same recoveries written as resid, resid_pre and resid_mid rows, and as heads and q, k, v
    rows: the same cells, the same numbers, no sender or receiver."""
    rng = random.Random(1)
    rows = []
    for i in range(N_PAIRS):
        pair = make_pair(f"p{i}", ROLES, subject=(0, 2))
        clean, corrupt = baselines(i)
        for layer in range(2):
            for pos in range(len(ROLES)):
                r = rng.uniform(-0.2, 1.0)
                for sweep in ("resid", "resid_pre", "resid_mid"):
                    rows.append(row(pair, r, sweep=sweep, site=sweep, layer=layer, position=pos, clean=clean,
                                    corrupt=corrupt))
            for head in range(2):
                for pos in (None, len(ROLES) - 1):
                    r = rng.uniform(-0.2, 1.0)
                    rows.append(row(pair, r, sweep="heads", site="head", layer=layer, position=pos, head=head,
                                    clean=clean, corrupt=corrupt))
                    for site in ("q", "k", "v"):
                        rows.append(row(pair, r, sweep="qkv", site=site, layer=layer, position=pos, head=head,
                                        clean=clean, corrupt=corrupt))
    wh, _ = load(tmp_path, rows)
    measures = ("n_pairs, mean_effect, effect_ci95_low, effect_ci95_high, n_recovery, mean_recovery, ci95_low, "
                "ci95_high, ratio_of_means")
    cell = "metric, layer, position_role, head, neuron, sender, receiver"

    def cells(sweep, site):
        return _rows(wh, f"SELECT {cell}, {measures} FROM effect_summary WHERE sweep = ? AND site = ? "
                         f"ORDER BY ALL", [sweep, site])

    resid = cells("resid", "resid")
    assert len(resid) == 2 * len(ROLES) * len(METRICS)
    for sweep in ("resid_pre", "resid_mid"):
        assert cells(sweep, sweep) == [{k: pytest.approx(v, rel=1e-12) if isinstance(v, float) else v
                                        for k, v in r.items()} for r in resid], sweep
    heads = cells("heads", "head")
    assert len(heads) == 2 * 2 * 2 * len(METRICS)
    for site in ("q", "k", "v"):
        assert cells("qkv", site) == [{k: pytest.approx(v, rel=1e-12) if isinstance(v, float) else v
                                       for k, v in r.items()} for r in heads], site
    assert query(wh, "SELECT count(*) FROM effect_summary WHERE sender IS NOT NULL OR receiver IS NOT NULL")[1] == [
        (0,)]
    assert query(wh, "SELECT count(*) FROM path_summary")[1] == [(0,)]
    # the layer x role and layer x head grids the report draws: one row per cell
    for view in ("effect_summary", "relation_summary", "effect_summary_facts"):
        dup = query(wh, f"SELECT count(*) FROM (SELECT run_id, sweep, site, metric, layer, position_role, head, "
                        f"count(*) c FROM {view} GROUP BY ALL HAVING c > 1)")[1]
        assert dup == [(0,)], view
