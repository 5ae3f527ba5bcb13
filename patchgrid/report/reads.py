"""What the report reads from the warehouse: its views, one function per question, each answer as
a list of rows (dicts). No figure is made here, and no sweep kind is named: the views select rows
by their shape, and a caller asking for one sweep's rows names it."""
from __future__ import annotations

import json


def rows(con, sql, params=()) -> list[dict]:
    cur = con.execute(sql, list(params))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def latest_completed_run(con) -> str | None:
    """The completed run that finished last (None: the warehouse holds no completed run)."""
    latest = con.execute("SELECT run_id FROM run_overview WHERE status = 'completed' "
                         "ORDER BY finished DESC NULLS LAST, started DESC NULLS LAST, run_id LIMIT 1").fetchone()
    return None if latest is None else latest[0]


def runs_by_status(con) -> list[dict]:
    """How many runs the warehouse holds of each status, and the latest started of each."""
    return rows(con, "SELECT status, count(*) AS n, arg_max(run_id, started) AS latest FROM run_overview "
                     "GROUP BY status ORDER BY n DESC, status")


def effect_rows(con, run_id: str) -> int:
    """How many effect rows the run loaded."""
    return con.execute("SELECT count(*) FROM effects WHERE run_id = ?", [run_id]).fetchone()[0]


def run_overview(con, run_id: str) -> dict | None:
    found = rows(con, "SELECT * FROM run_overview WHERE run_id = ?", [run_id])
    return found[0] if found else None


def run_params(params) -> dict:
    """The run's params (runs.params, JSON) as a dict."""
    try:
        params = json.loads(params) if isinstance(params, str) else (params or {})
    except ValueError:
        params = {"params": params}
    return params if isinstance(params, dict) else {"params": params}


def effect_summary(con, run_id: str) -> list[dict]:
    return rows(con, "SELECT * FROM effect_summary WHERE run_id = ?", [run_id])


def relation_summary(con, run_id: str, sweep: str, direction: str = "denoise") -> list[dict]:
    return rows(con, "SELECT * FROM relation_summary WHERE run_id = ? AND sweep = ? AND direction = ?",
                [run_id, sweep, direction])


def rejections(con, run_id: str) -> list[dict]:
    return rows(con, "SELECT reason, n FROM rejections WHERE run_id = ? ORDER BY n DESC", [run_id])


def trace_buckets(con, run_id: str, metric: str) -> list[dict]:
    return rows(con, "SELECT * FROM trace_buckets WHERE run_id = ? AND metric = ?", [run_id, metric])


def path_summary(con, run_id: str) -> list[dict]:
    return rows(con, "SELECT * FROM path_summary WHERE run_id = ?", [run_id])


def edge_summary(con, run_id: str) -> list[dict]:
    return rows(con, "SELECT * FROM edge_summary WHERE run_id = ?", [run_id])


def atp_summary(con, run_id: str) -> list[dict]:
    return rows(con, "SELECT * FROM atp_summary WHERE run_id = ?", [run_id])


def atp_agreement(con, run_id: str, sites) -> list[dict]:
    """atp_agreement's rows of the run beside their bootstrap intervals over pairs
    (warehouse/agreement.py), by site in the order of `sites`, then scope and metric."""
    from ..warehouse.agreement import agreement

    order = {site: k for k, site in enumerate(sites)}
    return sorted(agreement(con, run_id), key=lambda r: (order.get(r["site"], len(order)), r["site"], r["scope"],
                                                          r["metric"]))


def edge_agreement(con, run_id: str) -> list[dict]:
    """edge_agreement's rows of the run beside their bootstrap intervals over pairs (warehouse/agreement.py)."""
    from ..warehouse.agreement import edge_agreement as with_intervals

    return with_intervals(con, run_id)


def verified_estimates(con, run_id: str, limit: int) -> list[dict]:
    """Attribution patching's rows (row shape `estimate`) also patched exactly (their effect set), a
    deterministic sample of `limit` per site kind and metric at most, each with n_rows, how many there were."""
    return rows(con, """
        SELECT site, metric, verify, estimate, effect, n_rows FROM (
            SELECT site, metric, verify, estimate::DOUBLE AS estimate, effect::DOUBLE AS effect,
                   count(*) OVER (PARTITION BY site, metric) AS n_rows,
                   row_number() OVER (PARTITION BY site, metric
                                      ORDER BY hash(pair_id, layer, position, head, neuron)) AS k
            FROM effects WHERE run_id = ? AND row_shape = 'estimate' AND verify IS NOT NULL AND effect IS NOT NULL)
        WHERE k <= ? ORDER BY site, metric, verify DESC, k""", [run_id, limit])


def circuit_curve(con, run_id: str) -> list[dict]:
    return rows(con, "SELECT * FROM circuit_curve WHERE run_id = ? ORDER BY ablation, metric, size", [run_id])


def circuit_score(con, run_id: str) -> list[dict]:
    return rows(con, "SELECT * FROM circuit_score WHERE run_id = ? ORDER BY ablation, metric", [run_id])


def knockout_curve(con, run_id: str) -> list[dict]:
    return rows(con, "SELECT * FROM knockout_curve WHERE run_id = ? ORDER BY metric, blocked, layer", [run_id])


def circuit_edges(con, run_id: str, size: float, limit: int) -> list[dict]:
    """The first `limit` edges (by rank) of the run's circuit at `size`."""
    return rows(con, "SELECT * FROM circuit_edges WHERE run_id = ? AND size = ? ORDER BY rank LIMIT ?",
                [run_id, size, limit])


def graph_shape(con, run_id: str) -> dict | None:
    """The model's layers, heads and key/value heads as the run's edges show them (every head sends)."""
    got = rows(con, "SELECT max(sender_layer) + 1 AS n_layers, max(sender_head) + 1 AS n_heads, "
                    "max(receiver_head) FILTER (WHERE receiver_input = 'k') + 1 AS n_kv_heads "
                    "FROM edge_summary WHERE run_id = ?", [run_id])
    return got[0] if got and got[0]["n_layers"] is not None else None
