"""Attribution patching's agreement with exact patching, with intervals: the atp_agreement view's
rows of a run (views.sql: the point figures, per site kind, scope and metric) beside percentile
bootstrap intervals over pairs, which SQL does not make.

Each interval resamples the pairs of its (site kind, scope, metric) with replacement, `RESAMPLES`
times, seeded (the seed, and the group and figure, so a group's interval does not depend on which
other groups the run has), recomputes the figure on each resample, and takes the 2.5th and 97.5th
percentiles of the resamples where it is defined:
  pearson_random, spearman_random: over the pairs with random rows patched exactly, their rows
  pooled (a pair drawn twice brings its rows twice; Spearman's ranks ties by their mean rank);
  missed_share: the ratio sum(outside) / sum(outside + inside) over the pairs that enter it
  (atp_agreement_pairs: outside set);
  recall_top_k, recall_top_10: the mean over the pairs with a recall (n_pairs_exact) of theirs.
NULL below two pairs. The figures computed here from the view's rows (`pearson`, `spearman`,
`missed_share`, `mean`) are the view's, which the tests check.
"""
from __future__ import annotations

import zlib
from collections import defaultdict

import numpy as np

RESAMPLES = 1000
SEED = 0
GROUP = ("site", "scope", "metric")  # a run's agreement rows, one per (site kind, scope, metric)
INTERVALS = ("pearson_random", "spearman_random", "missed_share", "recall_top_k", "recall_top_10")


def pearson(x, y) -> float | None:
    """Pearson's correlation; None below two values or when either side is constant."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2:
        return None
    dx, dy = x - x.mean(), y - y.mean()
    sxx, syy = float(dx @ dx), float(dy @ dy)
    if sxx <= 0 or syy <= 0:
        return None
    return float(dx @ dy) / np.sqrt(sxx * syy)


def average_ranks(x) -> np.ndarray:
    """Ranks 1..n, tied values sharing the mean of the ranks they span."""
    _, inverse, counts = np.unique(np.asarray(x, dtype=float), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + 1 + ends) / 2)[inverse]


def spearman(x, y) -> float | None:
    """Spearman's correlation: Pearson's of the average ranks."""
    return pearson(average_ranks(x), average_ranks(y)) if len(x) >= 2 else None


def missed_share(outside, inside) -> float | None:
    total = float(np.sum(outside) + np.sum(inside))
    return float(np.sum(outside)) / total if total else None


def mean(values) -> float | None:
    return float(np.mean(values)) if len(values) else None


def percentile_interval(values) -> tuple[float | None, float | None]:
    got = [v for v in values if v is not None]
    if not got:
        return None, None
    low, high = np.percentile(got, [2.5, 97.5])
    return float(low), float(high)


def bootstrap(units: list, figure, rng: np.random.Generator, resamples: int) -> tuple[float | None, float | None]:
    """The percentile interval of `figure(resampled units)` over `resamples` resamples of the units
    (pairs) with replacement; (None, None) below two units."""
    n = len(units)
    if n < 2:
        return None, None
    draws = rng.integers(0, n, size=(resamples, n))
    return percentile_interval([figure([units[i] for i in draw]) for draw in draws])


def _pooled(figure):
    """A correlation over the rows of the pairs drawn, pooled: each unit is a pair's (estimates, effects)."""
    def of(units):
        return figure(np.concatenate([u[0] for u in units]), np.concatenate([u[1] for u in units]))
    return of


FIGURES = {  # figure -> (the units it resamples, what it computes from them)
    "pearson_random": ("random", _pooled(pearson)),
    "spearman_random": ("random", _pooled(spearman)),
    "missed_share": ("missed", lambda units: missed_share([u[0] for u in units], [u[1] for u in units])),
    "recall_top_k": ("recall_k", mean),
    "recall_top_10": ("recall_10", mean),
}


def units_of(con, run_id: str) -> dict[tuple, dict[str, list]]:
    """Per (site, scope, metric) of the run, the pairs each figure is over, one unit each: `random`,
    a pair's random rows patched exactly as (estimates, effects); `missed`, (outside, inside) of a pair
    entering missed_share; `recall_k` and `recall_10`, a pair's recalls."""
    out = defaultdict(lambda: defaultdict(list))
    by_pair = defaultdict(lambda: ([], []))
    for *group, pair_id, estimate, effect in con.execute(
            "SELECT site, scope, metric, pair_id, estimate, effect FROM atp_sites WHERE run_id = ? "
            "AND verify = 'random' AND effect IS NOT NULL AND estimate IS NOT NULL ORDER BY ALL", [run_id]).fetchall():
        rows = by_pair[(*group, pair_id)]
        rows[0].append(estimate)
        rows[1].append(effect)
    for (*group, _pair), (xs, ys) in sorted(by_pair.items()):
        out[tuple(group)]["random"].append((np.array(xs), np.array(ys)))
    for *group, outside, inside, recall_k, recall_10 in con.execute(
            "SELECT site, scope, metric, outside, inside, recall_k, recall_10 FROM atp_agreement_pairs "
            "WHERE run_id = ? ORDER BY site, scope, metric, pair_id", [run_id]).fetchall():
        units = out[tuple(group)]
        if outside is not None:
            units["missed"].append((outside, inside))
        if recall_k is not None:
            units["recall_k"].append(recall_k)
            units["recall_10"].append(recall_10)
    return out


def _rng(seed: int, group: tuple, figure: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(":".join(map(str, (*group, figure))).encode())])


def intervals(units: dict[str, list], group: tuple, *, resamples: int = RESAMPLES, seed: int = SEED) -> dict:
    """One group's bootstrap intervals: `<figure>_ci95_low` and `_ci95_high` for each of INTERVALS."""
    out = {}
    for name in INTERVALS:
        kind, figure = FIGURES[name]
        low, high = bootstrap(units.get(kind, []), figure, _rng(seed, group, name), resamples)
        out |= {f"{name}_ci95_low": low, f"{name}_ci95_high": high}
    return out


def points(units: dict[str, list]) -> dict:
    """The figures on the pairs as they are (no resampling): atp_agreement's, which a test checks."""
    return {name: FIGURES[name][1](units[FIGURES[name][0]]) if units.get(FIGURES[name][0]) else None
            for name in INTERVALS}


def agreement(con, run_id: str, *, resamples: int = RESAMPLES, seed: int = SEED) -> list[dict]:
    """atp_agreement's rows of the run (ordered by site, scope, metric), each with its bootstrap
    intervals over pairs (`<figure>_ci95_low`, `_ci95_high` for each of INTERVALS) and `resamples`."""
    cur = con.execute("SELECT * FROM atp_agreement WHERE run_id = ? ORDER BY site, scope, metric", [run_id])
    cols = [d[0] for d in cur.description]
    rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    units = units_of(con, run_id) if rows else {}
    for row in rows:
        group = tuple(row[c] for c in GROUP)
        row |= intervals(units.get(group, {}), group, resamples=resamples, seed=seed) | {"resamples": resamples}
    return rows


# Edge attribution's agreement (the edge_agreement view), one group per metric: the same figures
# resampled by pair; recall_important is 1 - missed_share, its interval missed_share's turned round.
EDGE_INTERVALS = ("pearson_random", "spearman_random", "missed_share")


def edge_units_of(con, run_id: str) -> dict[tuple, dict[str, list]]:
    """Per (metric,) of the run, its pairs as units: `random`, a pair's random edges patched exactly
    as (scores, effects); `missed`, (outside, inside) of a pair entering missed_share."""
    out = defaultdict(lambda: defaultdict(list))
    by_pair = defaultdict(lambda: ([], []))
    for metric, pair_id, estimate, effect in con.execute(
            "SELECT metric, pair_id, estimate, effect FROM edge_verified WHERE run_id = ? AND verify = 'random' "
            "ORDER BY ALL", [run_id]).fetchall():
        by_pair[(metric, pair_id)][0].append(estimate)
        by_pair[(metric, pair_id)][1].append(effect)
    for (metric, _pair), (xs, ys) in sorted(by_pair.items()):
        out[(metric,)]["random"].append((np.array(xs), np.array(ys)))
    for metric, outside, inside in con.execute(
            "SELECT metric, outside, inside FROM edge_agreement_pairs WHERE run_id = ? AND outside IS NOT NULL "
            "ORDER BY metric, pair_id", [run_id]).fetchall():
        out[(metric,)]["missed"].append((outside, inside))
    return out


def edge_agreement(con, run_id: str, *, resamples: int = RESAMPLES, seed: int = SEED) -> list[dict]:
    """edge_agreement's rows of the run (by metric), each with bootstrap intervals over pairs
    (`<figure>_ci95_low`, `_ci95_high` for each of EDGE_INTERVALS and recall_important) and `resamples`."""
    cur = con.execute("SELECT * FROM edge_agreement WHERE run_id = ? ORDER BY metric", [run_id])
    cols = [d[0] for d in cur.description]
    rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    units = edge_units_of(con, run_id) if rows else {}
    for row in rows:
        group = ("edges", row["metric"])
        mine = units.get((row["metric"],), {})
        for name in EDGE_INTERVALS:
            kind, figure = FIGURES[name]
            low, high = bootstrap(mine.get(kind, []), figure, _rng(seed, group, name), resamples)
            row |= {f"{name}_ci95_low": low, f"{name}_ci95_high": high}
        low, high = row["missed_share_ci95_low"], row["missed_share_ci95_high"]
        row |= {"recall_important_ci95_low": None if high is None else 1.0 - high,
                "recall_important_ci95_high": None if low is None else 1.0 - low, "resamples": resamples}
    return rows
