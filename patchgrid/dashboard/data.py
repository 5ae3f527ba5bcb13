"""What the dashboard reads, one function per question, each answer a list of rows (dicts). Every
read goes through the warehouse's query sandbox (`patchgrid.warehouse.loader.query`, the one
`patchgrid query` uses): a fresh read-only snapshot each time, so new runs show as they land, and
no statement that could change the warehouse or touch another file."""
from __future__ import annotations

from patchgrid.rows.shapes import POSITION_ROLES
from patchgrid.warehouse.loader import query

# A cell's identity in the summary views, beside run, sweep, direction and metric.
CELL = ("layer", "position_role", "head", "neuron", "sender", "receiver")
ALL_RELATIONS = "all relations"


def _rows(warehouse, sql: str, params=()) -> list[dict]:
    cols, found = query(warehouse, sql, list(params))
    return [dict(zip(cols, r)) for r in found]


def runs(warehouse) -> list[dict]:
    """Every run, the latest started first, with its parameters, state and counts (run_overview)."""
    return _rows(warehouse, """
        SELECT run_id, model, params, status, reason, started, finished, n_records, n_accepted, n_rejected, n_swept
        FROM run_overview ORDER BY started DESC NULLS LAST, run_id""")


def runs_signature(rows: list[dict]) -> tuple:
    """What changes when a run lands, starts or finishes: the page redraws when this does."""
    return tuple((r["run_id"], r["status"], str(r["finished"]), r["n_swept"]) for r in rows)


def filters(warehouse, run_id: str) -> dict:
    """The run's sweeps, directions, metrics and relations that have summary rows, each sorted."""
    found = _rows(warehouse, "SELECT DISTINCT sweep, direction, metric FROM effect_summary WHERE run_id = ?",
                  [run_id])
    relations = _rows(warehouse, "SELECT DISTINCT relation FROM relation_summary WHERE run_id = ? "
                                 "AND relation IS NOT NULL ORDER BY relation", [run_id])
    return {"sweeps": sorted({r["sweep"] for r in found}),
            "directions": sorted({r["direction"] for r in found}),
            "metrics": sorted({r["metric"] for r in found}),
            "relations": [r["relation"] for r in relations]}


def _order(row: dict) -> tuple:
    """A cell's place: by layer, its position role in the prompt's order, then head, neuron, path."""
    role = row["position_role"]
    key = [row["layer"], POSITION_ROLES.index(role) if role in POSITION_ROLES else len(POSITION_ROLES),
           row.get("head"), row.get("neuron"), row.get("sender"), row.get("receiver")]
    return tuple((v is None, v) for v in key)


def _labelled(rows: list[dict]) -> list[dict]:
    """The rows in cell order, each with its heatmap `column`."""
    return [r | {"column": column_label(r)} for r in sorted(rows, key=_order)]


def column_label(row: dict) -> str:
    """A cell's column in the heatmap: its position role, and its head, neuron or path where it has one."""
    parts = [str(row["position_role"])]
    if row.get("receiver") is not None:
        parts = [f"{row['sender']} -> {row['receiver']}", *parts]
    if row.get("head") is not None:
        parts.append(f"head {row['head']}")
    if row.get("neuron") is not None:
        parts.append(f"neuron {row['neuron']}")
    return " · ".join(parts)


def cells(warehouse, run_id: str, sweep: str, direction: str, metric: str,
          relation: str = ALL_RELATIONS) -> list[dict]:
    """A sweep's summary cells on one metric: over every pair (effect_summary) or one relation's
    (relation_summary), each with `column` (column_label) beside the view's columns."""
    if relation == ALL_RELATIONS:
        sql, params = "SELECT * FROM effect_summary WHERE run_id = ? AND sweep = ? AND direction = ? AND metric = ?", \
            [run_id, sweep, direction, metric]
    else:
        sql = ("SELECT * FROM relation_summary WHERE run_id = ? AND sweep = ? AND direction = ? AND metric = ? "
               "AND relation = ?")
        params = [run_id, sweep, direction, metric, relation]
    return _labelled(_rows(warehouse, sql, params))


def pair_ids(warehouse, run_id: str, sweep: str, relation: str = ALL_RELATIONS) -> list[str]:
    """The pairs with rows in the sweep (of one relation, unless all), sorted."""
    sql = "SELECT DISTINCT pair_id FROM pair_effects WHERE run_id = ? AND sweep = ?"
    params = [run_id, sweep]
    if relation != ALL_RELATIONS:
        sql, params = sql + " AND relation = ?", [*params, relation]
    return [r["pair_id"] for r in _rows(warehouse, sql + " ORDER BY pair_id", params)]


def pair_grid(warehouse, run_id: str, pair_id: str, sweep: str, direction: str, metric: str) -> list[dict]:
    """One pair's own grid: its effect and recovery per cell (pair_effects, windows averaged)."""
    keys = ", ".join(CELL)
    found = _rows(warehouse, f"""
        SELECT {keys}, any_value(relation) AS relation, avg(effect) AS effect, avg(recovery) AS recovery,
               avg(span) AS span
        FROM pair_effects WHERE run_id = ? AND pair_id = ? AND sweep = ? AND direction = ? AND metric = ?
        GROUP BY ALL""", [run_id, pair_id, sweep, direction, metric])
    return _labelled(found)


def cell_pairs(warehouse, run_id: str, sweep: str, direction: str, metric: str, cell: dict) -> list[dict]:
    """Every pair's values at one cell (its layer and column as the heatmap names them), the
    largest |effect| first (pair_effects, windows averaged)."""
    keys = ", ".join(CELL)
    found = _rows(warehouse, f"""
        SELECT pair_id, {keys}, any_value(relation) AS relation, avg(effect) AS effect,
               avg(recovery) AS recovery, avg(span) AS span
        FROM pair_effects WHERE run_id = ? AND sweep = ? AND direction = ? AND metric = ?
          AND layer IS NOT DISTINCT FROM ?
        GROUP BY ALL""", [run_id, sweep, direction, metric, cell["layer"]])
    chosen = [r for r in _labelled(found) if r["column"] == cell["column"]]
    return sorted(chosen, key=lambda r: (-abs(r["effect"] or 0.0), r["pair_id"]))


def value_column(rows: list[dict]) -> str:
    """What the heatmap colours: the mean recovery where the metric has one, else the mean effect (rank)."""
    return "mean_recovery" if any(r.get("mean_recovery") is not None for r in rows) else "mean_effect"
