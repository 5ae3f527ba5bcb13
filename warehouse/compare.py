"""Two runs' averaged cells side by side (`patchgrid compare`, `Warehouse.compare`): per cell and
metric, each run's mean and pairs, the difference B - A and a 95% t interval of it that holds for
small samples.

A cell is effect_summary's (sweep, site, direction, metric, layer, position role, head, neuron,
sender, receiver), its value per pair pair_effects_judged's, so the means are effect_summary's:
`effect` (every pair) or `recovery` (the pairs whose span is kept: kept_recovery). Where the two
runs share pairs in a cell (the same pair id at the same window), the interval is paired: Student's
t over the shared pairs' differences (interval `paired`, n_shared of them, n_shared - 1 degrees of
freedom), and the difference is the mean of those differences (mean_b - mean_a when every pair is
shared). Otherwise it is Welch's: mean_b - mean_a, standard error sqrt(var_a / n_a + var_b / n_b),
and the Welch-Satterthwaite degrees of freedom (interval `welch`, fractional: views.sql's t975). A
cell one run lacks is kept, the other side's columns empty; a cell without the pairs an interval
needs (two shared, or two on each side) has none (interval NULL).
"""
from __future__ import annotations

from patchgrid.metrics import METRICS
from patchgrid.rows.shapes import SWEEP_NAMES

from .loader import WarehouseError, query
from .queries import DEFAULT_METRICS

# What is compared: a name and its per-pair column of pair_effects_judged.
MEASURES = {"effect": "effect", "recovery": "kept_recovery"}
# effect_summary's cell, run aside (its order is the result's)
CELL = ("sweep", "site", "direction", "layer", "position_role", "head", "neuron", "sender", "receiver", "metric")
# A pair is the same pair in both runs when its id and its whole pair_effects key agree (window too).
PAIR_KEY = (*CELL, "window", "pair_id")
# The runs a refusal lists (newest first)
LISTED_RUNS = 5


def _same(left: str, right: str, columns) -> str:
    """Columns equal on both sides, NULL matching NULL (head, neuron, ... are NULL where they do not apply)."""
    return " AND ".join(f'{left}."{c}" IS NOT DISTINCT FROM {right}."{c}"' for c in columns)


def _sql(value: str, where_sweep: str) -> str:
    cell = ", ".join(f'"{c}"' for c in CELL)
    return f"""
WITH vals AS (
    SELECT run_id, pair_id, "window", {cell}, {value} AS v FROM pair_effects_judged
    WHERE run_id IN ($a, $b) AND metric = $metric AND {value} IS NOT NULL{where_sweep}
),
sides AS (
    SELECT {cell},
           count(*) FILTER (WHERE run_id = $a) AS n_a, avg(v) FILTER (WHERE run_id = $a) AS mean_a,
           var_samp(v) FILTER (WHERE run_id = $a) AS var_a,
           count(*) FILTER (WHERE run_id = $b) AS n_b, avg(v) FILTER (WHERE run_id = $b) AS mean_b,
           var_samp(v) FILTER (WHERE run_id = $b) AS var_b
    FROM vals GROUP BY ALL
),
shared AS (
    SELECT {", ".join(f'a."{c}"' for c in CELL)}, count(*) AS n_shared, avg(b.v - a.v) AS mean_d,
           var_samp(b.v - a.v) AS var_d
    FROM vals a JOIN vals b ON a.run_id = $a AND b.run_id = $b AND {_same("a", "b", PAIR_KEY)}
    GROUP BY ALL
),
chosen AS (
    SELECT s.*, coalesce(p.n_shared, 0) AS n_shared, p.mean_d, p.var_d,
           s.var_a / s.n_a AS va, s.var_b / s.n_b AS vb,
           CASE WHEN p.n_shared >= 2 THEN 'paired' WHEN s.n_a >= 2 AND s.n_b >= 2 THEN 'welch' END AS interval
    FROM sides s LEFT JOIN shared p ON {_same("s", "p", CELL)}
),
measured AS (
    SELECT *,
           CASE WHEN interval = 'paired' THEN mean_d ELSE mean_b - mean_a END AS difference,
           CASE interval WHEN 'paired' THEN sqrt(var_d / n_shared) WHEN 'welch' THEN sqrt(va + vb) END AS se,
           CASE interval WHEN 'paired' THEN n_shared - 1
                WHEN 'welch' THEN (va + vb) ^ 2 / nullif(va ^ 2 / (n_a - 1) + vb ^ 2 / (n_b - 1), 0) END AS df
    FROM chosen
)
SELECT {cell}, $measure AS measure,
       nullif(n_a, 0) AS n_a, mean_a, nullif(n_b, 0) AS n_b, mean_b, n_shared, difference,
       difference - t975(df) * se AS ci95_low, difference + t975(df) * se AS ci95_high, df, interval
FROM measured
ORDER BY abs(difference) DESC NULLS LAST, {", ".join(f'"{c}" NULLS FIRST' for c in CELL)}
LIMIT $top"""


def _check_runs(path, run_a: str, run_b: str) -> None:
    """Refused, in one line: the same run twice, a run the warehouse does not hold (naming the ones it
    does), two runs of different models."""
    if run_a == run_b:
        raise WarehouseError(f"compare: run {run_a!r} given twice; compare two different runs")
    _, rows = query(path, "SELECT run_id, model, model_hash FROM runs ORDER BY started DESC NULLS LAST, run_id")
    models = {run_id: (model, model_hash) for run_id, model, model_hash in rows}
    for run_id in (run_a, run_b):
        if run_id not in models:
            listed = ", ".join(r for r, *_ in rows[:LISTED_RUNS]) or "none"
            more = f" (and {len(rows) - LISTED_RUNS} more)" if len(rows) > LISTED_RUNS else ""
            raise WarehouseError(f"compare: no run {run_id!r} in warehouse {path}; its runs, newest first: "
                                 f"{listed}{more}")
    (model_a, hash_a), (model_b, hash_b) = models[run_a], models[run_b]
    if model_a != model_b or (hash_a and hash_b and hash_a != hash_b):
        raise WarehouseError(f"compare: runs {run_a!r} ({model_a}) and {run_b!r} ({model_b}"
                             f"{', other weights' if model_a == model_b else ''}) are of different models; "
                             f"their cells are not comparable")


def _default_metric(path, run_a: str, run_b: str) -> str:
    """The first of DEFAULT_METRICS both runs have values on (logprob_diff, else logit_diff)."""
    first, fallback = DEFAULT_METRICS
    has = f"EXISTS (SELECT 1 FROM effects WHERE run_id = ? AND patched_{first} IS NOT NULL)"
    _, [(both,)] = query(path, f"SELECT {has} AND {has}", [run_a, run_b])
    return first if both else fallback


def compare(path, run_a: str, run_b: str, *, sweep: str | None = None, metric: str | None = None,
            measure: str = "effect", top: int | None = None, arrow: bool = False):
    """Run B's cells against run A's on `metric` (None: logprob_diff where both runs have it, else
    logit_diff) and `measure` (effect or recovery), largest |difference| first, `top` of them (None:
    all), only `sweep`'s when given; as (columns, rows), or a pyarrow table with `arrow`. The module's
    docstring says what each column is. Raises WarehouseError (a ValueError) for runs that cannot be
    compared, a ValueError for an unknown metric, measure or sweep."""
    if metric is not None and metric not in METRICS:
        raise ValueError(f"compare: metric {metric!r} is not one of {', '.join(METRICS)}")
    if measure not in MEASURES:
        raise ValueError(f"compare: measure {measure!r} is not one of {', '.join(MEASURES)}")
    if sweep is not None and sweep not in SWEEP_NAMES:
        raise ValueError(f"compare: sweep {sweep!r} is not one of {', '.join(SWEEP_NAMES)}")
    if top is not None and top < 1:
        raise ValueError(f"compare: top {top} must be at least 1")
    _check_runs(path, run_a, run_b)
    params = {"a": run_a, "b": run_b, "metric": metric or _default_metric(path, run_a, run_b), "measure": measure,
              "top": top}
    where_sweep = ""
    if sweep is not None:
        where_sweep, params["sweep"] = " AND sweep = $sweep", sweep
    return query(path, _sql(MEASURES[measure], where_sweep), params, arrow=arrow)
