"""Sweeps over many pairs: equal to the reference backend, chunk-independent, deterministic."""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import replace

import pytest

from patchgrid.cache import CacheError, load_or_build
from patchgrid.metrics import METRICS
from patchgrid.rows.shapes import EFFECT_SHAPES, KNOCKOUT_DIRECTION, KNOCKOUT_SITE
from patchgrid.sweeps import SWEEP_KINDS, SweepConfig, cache_spec, count_runs, run_sweeps, trace_window
from tests.support.engines import PRETRAINED_SLOW, needs_vllm
from tests.support.pairs import noise_std_for, shipped_pairs

ALL = SweepConfig(sweeps=("resid", "attn_out", "mlp_out", "heads", "trace"), trace_samples=2, max_requests=700)


def _long_answers(pairs):
    """The first pair's answers scored whole (3 and 2 tokens), the second's one of 4 tokens and one
    of 1; the rest one-token."""
    out = list(pairs)
    a, b = out[0].clean_answer_id, out[0].corrupt_answer_id
    out[0] = replace(out[0], clean_answer_ids=(a, 11, 12), corrupt_answer_ids=(b, 13))
    out[1] = replace(out[1], clean_answer_ids=(out[1].clean_answer_id, 21, 22, 23))
    return out


def _key(row):
    return (row["pair_id"], row["sweep"], row["site"], row["direction"], row["layer"], row["position"], row["head"],
            row["window"], row.get("blocked"))


def _in_their_shapes(rows):
    """Each row sets only columns of the shape its kind declares (what the warehouse files it under)."""
    for r in rows:
        shape = EFFECT_SHAPES[SWEEP_KINDS[r["sweep"]].row_shape]
        assert {column for column, value in r.items() if value is not None} <= set(shape.columns), r["sweep"]


def _by_key(rows):
    out = {_key(r): r for r in rows}
    assert len(out) == len(rows), "effect rows are not unique by their cell (_key)"
    return out


# One model: what a sweep kind computes does not depend on the family; every family's sites, started
# runs included, are held to the hf reference in tests/engine/backends/.
@needs_vllm
@pytest.mark.parametrize("model", ["tiny-llama"])
def test_every_sweep_kind_equals_the_hf_backend(tmp_path, engines, tokenizers, model):
    vl = engines.get(model, "vllm", dtype="float32")
    hf = engines.get(model, "hf", dtype="float32")
    pairs = _long_answers(shipped_pairs(tokenizers(model), 3))
    std = noise_std_for(hf, pairs)
    cache, _ = load_or_build(vl, pairs, cache_spec(ALL, vl.shape.n_layers, std), tmp_path, log=lambda *_: None)
    a, b = _by_key(run_sweeps(vl, pairs, cache, ALL)), _by_key(run_sweeps(hf, pairs, cache, ALL))
    # every layer of every cell run, cells that change nothing included: what the shortcuts stand for
    full = replace(ALL, start_midstack=False)
    c, d = _by_key(run_sweeps(vl, pairs, cache, full)), _by_key(run_sweeps(hf, pairs, cache, full))
    assert a.keys() == b.keys() == c.keys() == d.keys()
    assert {k[1] for k in a} == {"resid", "attn_out", "mlp_out", "heads", "trace"}
    for k in a:
        for other in (b, c, d):
            for m in METRICS:  # every metric, of answers of one token and of several
                assert a[k][f"patched_{m}"] == pytest.approx(other[k][f"patched_{m}"], abs=1e-4), (k, m)
            assert a[k]["patched_logp_clean_tokens"] == pytest.approx(other[k]["patched_logp_clean_tokens"], abs=1e-4)
    # cells before the first change (before the subject) were not run: they equal their baselines
    early = [k for k in a if k[5] is not None and k[5] < pairs[0].subject_start and k[0] == pairs[0].pair_id]
    assert early and all(a[k]["effect"] == 0 for k in early)
    spread = max(r["patched_logprob_diff"] for r in a.values()) - min(r["patched_logprob_diff"] for r in a.values())
    assert spread > 0.05
    assert max(r["patched_kl"] for r in a.values()) > 0.01


def test_rows_are_complete_and_consistent(tmp_path, engines, tokenizers):
    hf = engines.get("tiny-gpt2", "hf", dtype="float32")
    pairs = _long_answers(shipped_pairs(tokenizers("tiny-gpt2"), 3))
    cache, _ = load_or_build(hf, pairs, cache_spec(ALL, 4, noise_std_for(hf, pairs)), tmp_path, log=lambda *_: None)
    rows = run_sweeps(hf, pairs, cache, ALL)
    _in_their_shapes(rows)
    whole = {p.pair_id for p in pairs[:2]}  # answers scored whole: no logit difference, headline logprob_diff
    non_trace = [r for r in rows if r["sweep"] != "trace"]
    n_trace = sum(len(p.clean_ids) * 4 * 3 for p in pairs)  # positions x layers x (resid, mlp, attn)
    assert len(non_trace) + n_trace * ALL.trace_samples + len(pairs) * ALL.trace_samples == \
        count_runs(pairs, ALL, 4, 4)
    assert len(rows) - len(non_trace) == n_trace  # one trace row per restored site, averaged over samples
    for r in rows:
        for m in METRICS:
            for prefix in ("patched", "clean", "corrupt"):
                assert (r[f"{prefix}_{m}"] is None) == (m == "logit_diff" and r["pair_id"] in whole), (prefix, m)
        assert r["clean_kl"] == 0 and r["effect"] is not None
        lengths = (3, 2) if r["pair_id"] == pairs[0].pair_id else (4, 1) if r["pair_id"] == pairs[1].pair_id else (1, 1)
        assert (len(r["patched_logp_clean_tokens"]), len(r["patched_logp_corrupt_tokens"])) == lengths
        assert r["patched_logprob_diff"] == pytest.approx(r["patched_logp_clean"] - r["patched_logp_corrupt"], abs=1e-5)
        if r["sweep"] != "trace":  # a trace row averages p and log p over samples: exp(mean log p) is not mean p
            assert r["patched_p"] == pytest.approx(2.718281828 ** r["patched_logp_clean"], rel=1e-4)
        if r["pair_id"] not in whole:  # one-token answers: one normaliser, so the two differences agree
            assert r["patched_logprob_diff"] == pytest.approx(r["patched_logit_diff"], abs=1e-4)
        if r["sweep"] == "trace":
            assert r["metric"] == "p" and r["effect"] == pytest.approx(r["patched_p"] - r["corrupt_p"])
        else:
            m = "logprob_diff" if r["pair_id"] in whole else "logit_diff"
            span = r[f"clean_{m}"] - r[f"corrupt_{m}"]
            assert r["metric"] == m
            assert r["recovery"] == pytest.approx((r[f"patched_{m}"] - r[f"corrupt_{m}"]) / span)
        assert (r["position"] is None) == (r["position_role"] == "all")
        assert (r["head"] is not None) == (r["sweep"] == "heads")
        assert (r["window"] is not None) == (r["sweep"] == "trace" and r["site"] != "resid")
        if r["window"] is not None:  # the layers actually restored, cut at the model's ends
            assert r["window"] == len(trace_window(r["layer"], ALL.trace_window, 4)) < ALL.trace_window
    assert {r["direction"] for r in rows if r["sweep"] == "resid"} == {"denoise", "noise"}
    heads_all = [r for r in rows if r["sweep"] == "heads" and r["position"] is None]
    assert len(heads_all) == len(pairs) * 4 * 4
    assert {r["position_role"] for r in rows if r["sweep"] == "heads"} == {"all", "subject_last", "last"}


def test_chunking_and_reruns_do_not_change_a_number(tmp_path, engines, tokenizers):
    hf = engines.get("tiny-llama", "hf", dtype="float32")
    pairs = shipped_pairs(tokenizers("tiny-llama"), 3)
    cfg = SweepConfig(sweeps=("resid", "trace"), trace_samples=3, max_requests=10_000)
    std = noise_std_for(hf, pairs)
    cache, _ = load_or_build(hf, pairs, cache_spec(cfg, 4, std), tmp_path, log=lambda *_: None)
    a = _by_key(run_sweeps(hf, pairs, cache, cfg))
    b = _by_key(run_sweeps(hf, pairs, cache, SweepConfig(sweeps=("resid", "trace"), trace_samples=3, max_requests=37)))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k]["patched_p"] == pytest.approx(b[k]["patched_p"], abs=1e-6)
    seeded = SweepConfig(sweeps=("resid", "trace"), trace_samples=3, seed=1)
    with pytest.raises(CacheError, match="seed 1"):  # the cached noised runs were drawn with seed 0
        run_sweeps(hf, pairs, cache, seeded)
    cache1, _ = load_or_build(hf, pairs, cache_spec(seeded, 4, std), tmp_path, log=lambda *_: None)
    c = _by_key(run_sweeps(hf, pairs, cache1, seeded))
    assert any(abs(a[k]["patched_p"] - c[k]["patched_p"]) > 1e-9 for k in a if k[1] == "trace")


@needs_vllm
def test_a_study_reads_only_the_metrics_it_asks_and_each_sweeps_headline(tmp_path, engines, tokenizers):
    """`metrics`: the patched runs read those metrics and each sweep's headline (logprob_diff for
    answers of several tokens, p for trace), with the numbers of a run reading every metric; the
    rest is NULL in the patched columns (unchanged cells too), the baselines keep every metric."""
    vl = engines.get("tiny-llama", "vllm", dtype="float32")
    pairs = _long_answers(shipped_pairs(tokenizers("tiny-llama"), 3))
    cfg = SweepConfig(sweeps=("resid", "heads", "trace"), trace_samples=2)
    cache, _ = load_or_build(vl, pairs, cache_spec(cfg, 4, noise_std_for(vl, pairs)), tmp_path, log=lambda *_: None)
    every = _by_key(run_sweeps(vl, pairs, cache, cfg))
    whole = {p.pair_id for p in pairs[:2]}  # answers of several tokens
    for asked in (("logit_diff",), ("kl", "rank")):
        some = _by_key(run_sweeps(vl, pairs, cache, replace(cfg, metrics=asked)))
        assert some.keys() == every.keys()
        for k, row in some.items():
            head = "p" if k[1] == "trace" else "logprob_diff" if k[0] in whole else "logit_diff"
            assert row["metric"] == head and row["effect"] == pytest.approx(every[k]["effect"], abs=1e-6)
            for m in METRICS:
                read = m in asked or m == head
                if m == "logit_diff" and k[0] in whole:
                    read = False  # answers of several tokens have none
                assert (row[f"patched_{m}"] is not None) == read, (k, m)
                if read:
                    assert row[f"patched_{m}"] == pytest.approx(every[k][f"patched_{m}"], abs=1e-6), (k, m)
                assert row[f"clean_{m}"] == every[k][f"clean_{m}"]
    with pytest.raises(ValueError, match="unknown metric 'accuracy'"):
        SweepConfig(metrics=("accuracy",))
    with pytest.raises(ValueError, match=r"metrics: unknown metric \(none\)"):
        SweepConfig(metrics=())


def _mean_by(rows, sweep, site):
    acc = defaultdict(list)
    for r in rows:
        if r["sweep"] == sweep and r["site"] == site and r["direction"] == "denoise":
            acc[(r["position_role"], r["layer"])].append(r["recovery"] if sweep != "trace" else r["effect"])
    return {k: statistics.mean(v) for k, v in acc.items()}


@pytest.mark.slow
@needs_vllm
def test_smollm2_shapes_averaged_over_pairs(tmp_path, engines, tokenizers):
    engine = engines.get("smollm2-135m", "vllm", **PRETRAINED_SLOW)
    pairs = shipped_pairs(tokenizers("smollm2-135m"), 10, engine=engine, max_len=engine.shape.max_len)
    assert len({p.relation for p in pairs}) >= 8
    cfg = SweepConfig(sweeps=("resid", "trace"), resid_directions=("denoise",), trace_samples=2,
                      trace_sites=("resid",))
    std = noise_std_for(engine, pairs)
    cache, _ = load_or_build(engine, pairs, cache_spec(cfg, engine.shape.n_layers, std), tmp_path,
                             log=lambda *_: None)
    rows = run_sweeps(engine, pairs, cache, cfg)
    n = engine.shape.n_layers
    early, late = range(0, n // 3), range(n - 3, n)
    resid = _mean_by(rows, "resid", "resid")
    # the last subject token's stream carries the answer early and not late; the last token the reverse
    assert min(resid[("subject_last", layer)] for layer in early) > 0.7
    assert max(resid[("subject_last", layer)] for layer in late) < 0.2
    assert max(resid[("last", layer)] for layer in early) < 0.2
    assert min(resid[("last", layer)] for layer in late) > 0.7
    # causal tracing: restoring the hidden state helps most at the last subject token, early to middle
    # (the last token takes over in late layers, where the answer has moved there)
    trace = _mean_by(rows, "trace", "resid")
    peak_role, peak_layer = max((k for k in trace if k[0] != "last"), key=trace.get)
    assert peak_role == "subject_last" and peak_layer < 2 * n // 3
    for layer in range(n // 2):
        others = [v for (role, lay), v in trace.items() if lay == layer and role != "subject_last"]
        assert trace[("subject_last", layer)] > max(others)


@needs_vllm
def test_pattern_and_knockout_sweeps_equal_the_hf_backend(tmp_path, engines, tokenizers):
    """Both kinds on vLLM against hf, started mid-stack and not, answers of several tokens among the
    pairs; knockout rows stand on the clean run, one per group and layer, their window cut at the ends."""
    vl = engines.get("tiny-llama", "vllm", dtype="float32")
    hf = engines.get("tiny-llama", "hf", dtype="float32")
    pairs = _long_answers(shipped_pairs(tokenizers("tiny-llama"), 3))
    cfg = SweepConfig(sweeps=("pattern", "knockout"), knockout_window=3, trace_facts="first-token")
    cache, _ = load_or_build(vl, pairs, cache_spec(cfg, vl.shape.n_layers), tmp_path, log=lambda *_: None)
    a, b = _by_key(run_sweeps(vl, pairs, cache, cfg)), _by_key(run_sweeps(hf, pairs, cache, cfg))
    full = replace(cfg, start_midstack=False)
    c = _by_key(run_sweeps(vl, pairs, cache, full))
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        for other in (b, c):
            for m in METRICS:
                assert a[k][f"patched_{m}"] == pytest.approx(other[k][f"patched_{m}"], abs=1e-4), (k, m)
    _in_their_shapes(a.values())
    knock = [r for r in a.values() if r["sweep"] == "knockout"]
    n = vl.shape.n_layers
    assert len(knock) == sum(n * (3 if p.subject_start > 0 or p.subject_end < len(p.clean_ids) - 1 else 2)
                             for p in pairs)
    for r in knock:
        assert r["metric"] == "p" and r["direction"] == KNOCKOUT_DIRECTION and r["site"] == KNOCKOUT_SITE
        assert r["effect"] == pytest.approx(r["patched_p"] - r["clean_p"], abs=1e-6)
        assert r["window"] == len(trace_window(r["layer"], 3, n)) and r["position_role"] == "last"
    assert {r["blocked"] for r in knock} == {"subject", "non_subject", "last"}
    assert max(abs(r["patched_logp_clean"] - r["clean_logp_clean"]) for r in knock) > 1e-2  # (p is tiny here)
    patterns = [r for r in a.values() if r["sweep"] == "pattern"]
    assert {r["position_role"] for r in patterns} == {"all", "subject_last", "last"}
    assert len({r["head"] for r in patterns}) == vl.shape.n_heads and all(r.get("blocked") is None for r in patterns)

