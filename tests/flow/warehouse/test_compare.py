"""Two runs compared (warehouse/compare.py, `patchgrid compare`, Warehouse.compare): the difference B - A
per cell with a paired t interval over shared pairs or Welch's otherwise, each checked against the
formulas computed here (the t quantile by integrating Student's density), on two real runs (tiny-llama,
seeds 0 and 1: some pairs keep their partner, some do not) and on hand-built runs; cells one run lacks
kept; refusals in one line."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

import patchgrid
from patchgrid.warehouse.compare import CELL, compare
from patchgrid.warehouse.loader import query
from tests.support.pairs import DATA
from tests.unit.warehouse.test_compare import paired, records


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory, prefect_api):
    """Two studies of three pairs of the shipped facts on tiny-llama (hf), the resid sweep, subject-swap
    partners drawn with seeds 0 and 1 (two of the three pairs get another partner)."""
    tmp = tmp_path_factory.mktemp("real")
    wh = tmp / "warehouse.duckdb"
    runs = [patchgrid.study(model="tiny-llama", pairs=str(DATA), sweeps="resid", limit=3, require_known=False,
                            backend="hf", seed=seed, warehouse=str(wh), workdir=str(tmp / "work")).run_id
            for seed in (0, 1)]
    return wh, *runs


def _pair_values(wh, run_id: str, metric: str) -> dict[tuple, dict[tuple, float]]:
    """run_id's pair_effects on metric: cell -> (pair id, window) -> effect."""
    cols, rows = query(wh, "SELECT * FROM pair_effects WHERE run_id = ? AND metric = ?", [run_id, metric])
    out = defaultdict(dict)
    for r in records(cols, rows):
        out[tuple(r[c] for c in CELL)][(r["pair_id"], r["window"])] = r["effect"]
    return out


def test_two_real_runs_paired_over_their_shared_pairs(real_runs):
    wh, run_a, run_b = real_runs
    params = {r: json.loads(p)["seed"] for r, p in query(wh, "SELECT run_id, params FROM runs")[1]}
    assert params == {run_a: 0, run_b: 1}
    cols, rows = compare(wh, run_a, run_b)
    got = records(cols, rows)
    assert got and {r["metric"] for r in got} == {"logprob_diff"}
    a, b = _pair_values(wh, run_a, "logprob_diff"), _pair_values(wh, run_b, "logprob_diff")
    assert {tuple(r[c] for c in CELL) for r in got} == set(a) | set(b)
    checked = 0
    for r in got:
        key = tuple(r[c] for c in CELL)
        shared = sorted(set(a.get(key, {})) & set(b.get(key, {})))
        assert r["n_shared"] == len(shared) and r["n_a"] == (len(a[key]) if key in a else None)
        if len(shared) >= 2:
            diff, low, high = paired([a[key][p] for p in shared], [b[key][p] for p in shared])
            assert r["interval"] == "paired" and r["difference"] == pytest.approx(diff, rel=1e-6, abs=1e-9)
            assert (r["ci95_low"], r["ci95_high"]) == pytest.approx((low, high), rel=2e-4, abs=1e-9)
            checked += r["ci95_high"] > r["ci95_low"]
    assert checked > 0  # intervals of some width were checked: the seeds gave some pairs other partners
    diffs = [abs(r["difference"]) for r in got if r["difference"] is not None]
    assert diffs == sorted(diffs, reverse=True) and max(diffs) > 0

