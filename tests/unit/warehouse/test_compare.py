"""Two runs compared (warehouse/compare.py, `patchgrid compare`, Warehouse.compare): the difference B - A
per cell with a paired t interval over shared pairs or Welch's otherwise, each checked against the
formulas computed here (the t quantile by integrating Student's density), on two real runs (tiny-llama,
seeds 0 and 1: some pairs keep their partner, some do not) and on hand-built runs; cells one run lacks
kept; refusals in one line."""
from __future__ import annotations

import math
import re
import statistics

import numpy as np
import pytest

import patchgrid
from patchgrid.pairs import to_table as pairs_table
from patchgrid.rows.effects import write_effects
from patchgrid.warehouse.compare import compare
from patchgrid.warehouse.loader import WarehouseError, load_run, query, start_run
from tests.support.effect_rows import make_pair, row

ROLES = ("subject_last", "last")


def t975(df: float) -> float:
    """Student's t quantile at 0.975: the density integrated (Simpson's rule), the bound found by bisection."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(t):
        x = np.linspace(0.0, t, 20001)
        f = c * (1 + x * x / df) ** (-(df + 1) / 2)
        return 0.5 + (x[1] - x[0]) / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    lo, hi = 0.0, 20.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < 0.975 else (lo, mid)
    return (lo + hi) / 2


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    d = [y - x for x, y in zip(a, b)]
    mean, half = statistics.fmean(d), t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return mean, mean - half, mean + half


def welch(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    diff, half = statistics.fmean(b) - statistics.fmean(a), t975(df) * math.sqrt(va + vb)
    return diff, diff - half, diff + half, df


def records(cols, rows) -> list[dict]:
    return [dict(zip(cols, r)) for r in rows]


def _load(wh, tmp, run_id: str, values: dict[str, float], *, model="m", layers=(0,)):
    """A run whose pairs (id -> recovery r; logit_diff effect 4 r) are patched at the resid `layers`."""
    rows = [row(make_pair(pid, ROLES), r, layer=layer, position=1) for pid, r in values.items() for layer in layers]
    start_run(wh, {"run_id": run_id, "model": model})
    load_run(wh, run_id, pairs_table([{"pair_id": pid, "relation": "r", "status": "accepted", "clean_prompt": "c",
                                       "corrupt_prompt": "x", "roles": list(ROLES), "subject_start": 0,
                                       "subject_end": 1} for pid in values]),
             [], [write_effects(rows, tmp / f"{run_id}.parquet")])


A = {"p0": 0.1, "p1": 0.3, "p2": 0.8}


B = {"q0": 0.5, "q1": 0.6, "q2": 0.9, "q3": 1.7}  # other pairs: Welch


C = {"p0": 0.2, "p1": 0.6, "p2": 0.7, "c3": 2.0}  # A's three pairs and one more: paired over three


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("built")
    wh = tmp / "w.duckdb"
    _load(wh, tmp, "a", A, layers=(0, 1))  # layer 1: a cell only run a has
    _load(wh, tmp, "b", B)
    _load(wh, tmp, "c", C)
    _load(wh, tmp, "other", A, model="m2")
    return wh


def _cell(result, layer=0, role="last"):
    [got] = [r for r in records(*result) if r["layer"] == layer and r["position_role"] == role]
    return got


def test_welch_interval_when_the_runs_share_no_pair(built):
    got = _cell(compare(built, "a", "b", metric="logit_diff"))
    a, b = [4 * r for r in A.values()], [4 * r for r in B.values()]
    diff, low, high, df = welch(a, b)
    assert (got["interval"], got["n_a"], got["n_b"], got["n_shared"]) == ("welch", 3, 4, 0)
    assert (got["metric"], got["measure"]) == ("logit_diff", "effect")
    assert got["mean_a"] == pytest.approx(statistics.fmean(a), rel=1e-6)
    assert got["difference"] == pytest.approx(diff, rel=1e-6) and got["df"] == pytest.approx(df, rel=1e-6)
    assert df != int(df)  # a fractional df: t975 between its whole neighbours, within 0.13%
    assert (got["ci95_low"], got["ci95_high"]) == pytest.approx((low, high), rel=2e-3)
    recovery = _cell(compare(built, "a", "b", metric="logit_diff", measure="recovery"))
    assert recovery["measure"] == "recovery"
    assert recovery["difference"] == pytest.approx(welch(list(A.values()), list(B.values()))[0], rel=1e-5)


def test_paired_interval_over_the_shared_pairs(built):
    got = _cell(compare(built, "a", "c", metric="logit_diff"))
    shared = sorted(A)
    diff, low, high = paired([4 * A[p] for p in shared], [4 * C[p] for p in shared])
    assert (got["interval"], got["n_a"], got["n_b"], got["n_shared"], got["df"]) == ("paired", 3, 4, 3, 2)
    # the difference is over the shared pairs, not mean_b - mean_a (c3 is c's alone)
    assert got["difference"] == pytest.approx(diff, rel=1e-5)
    assert got["mean_b"] - got["mean_a"] != pytest.approx(diff, rel=1e-3)
    assert (got["ci95_low"], got["ci95_high"]) == pytest.approx((low, high), rel=2e-4)


def test_a_cell_only_one_run_has_is_kept_with_the_other_side_empty(built):
    got = _cell(compare(built, "a", "b", metric="logit_diff"), layer=1)
    assert got["n_a"] == 3 and got["mean_a"] == pytest.approx(4 * statistics.fmean(A.values()), rel=1e-6)
    assert [got[k] for k in ("n_b", "mean_b", "difference", "ci95_low", "ci95_high", "interval")] == [None] * 6
    reverse = _cell(compare(built, "b", "a", metric="logit_diff"), layer=1)
    assert reverse["n_a"] is None and reverse["n_b"] == 3
    # sorted by |difference|, the cell without one last; --top keeps the first
    result = records(*compare(built, "a", "b", metric="logit_diff"))
    assert result[-1]["layer"] == 1 and result[0]["difference"] is not None
    assert len(compare(built, "a", "b", metric="logit_diff", top=1)[1]) == 1


@pytest.mark.parametrize("run_a, run_b, message", [
    ("a", "a", "compare: run 'a' given twice"),
    ("a", "nope", "compare: no run 'nope' in warehouse"),
    ("a", "other", "compare: runs 'a' (m) and 'other' (m2) are of different models"),
])
def test_refusals(built, run_a, run_b, message):
    with pytest.raises(WarehouseError, match=re.escape(message)) as err:
        compare(built, run_a, run_b)
    assert "\n" not in str(err.value)
    if "nope" in message:
        assert "its runs, newest first: " in str(err.value) and "other" in str(err.value)


def test_unknown_metric_and_measure_are_refused(built):
    with pytest.raises(ValueError, match="metric 'logit' is not one of logit_diff"):
        compare(built, "a", "b", metric="logit")
    with pytest.raises(ValueError, match="measure 'ratio' is not one of effect, recovery"):
        compare(built, "a", "b", measure="ratio")


@pytest.mark.parametrize("df", [1.3, 2.44, 3.7, 5.5, 9.99, 10.5, 33.3])
def test_t_quantile_at_fractional_degrees_of_freedom(built, df):
    assert query(built, "SELECT t975(?::DOUBLE)", [df])[1][0][0] == pytest.approx(t975(df), rel=1.3e-3)


def test_the_api_returns_the_same_cells_as_a_frame(built):
    frame = patchgrid.open(built).compare("a", "c", metric="logit_diff")
    cols, rows = compare(built, "a", "c", metric="logit_diff")
    assert list(frame.columns) == cols and len(frame) == len(rows)
    assert frame.iloc[0].difference == pytest.approx(rows[0][cols.index("difference")])

