"""What a study did, read back from the warehouse once its flow has returned (read-only queries,
through the same sandbox as `patchgrid query`): its records and why any were rejected, its sweeps
and their patched runs, its time, the strongest averaged cells of each sweep (and edges, knockouts' lowest
layers, and circuits' CPR
and CMD), and the commands
that query it and draw its report. Plain values: the command line prints them (patchgrid/cli/study.py)
or writes them as JSON."""
from __future__ import annotations

from pathlib import Path

from ..runtime.console import shell_command
from ..warehouse.loader import query
from ..warehouse.queries import ranked_by_sql, strength_sql

STRONGEST_PER_SWEEP = 3  # cells shown for each sweep


def _rows(warehouse, sql: str, params) -> list[dict]:
    cols, rows = query(warehouse, sql, params)
    return [dict(zip(cols, r)) for r in rows]


def records(warehouse, run_id: str) -> dict:
    """The run's input records: how many were read, accepted, rejected and not judged (a study's limit
    reached before them: patchgrid.pairs.limit), which add up to those read, and the rejections by
    reason (most frequent first)."""
    from ..pairs.limit import NOT_JUDGED

    counts = _rows(warehouse, "SELECT status, reason, count(*) AS n FROM pairs WHERE run_id = ? GROUP BY ALL "
                              "ORDER BY n DESC, reason", [run_id])
    accepted = sum(c["n"] for c in counts if c["status"] == "accepted")
    not_judged = sum(c["n"] for c in counts if c["status"] == "rejected" and c["reason"] == NOT_JUDGED)
    by_reason = {c["reason"]: c["n"] for c in counts if c["status"] == "rejected" and c["reason"] != NOT_JUDGED}
    return {"read": accepted + sum(by_reason.values()) + not_judged, "accepted": accepted,
            "rejected": sum(by_reason.values()), "not_judged": not_judged, "rejected_by_reason": by_reason}


def sweeps(warehouse, run_id: str) -> list[dict]:
    """Each sweep of the run: the pairs it ran on, its effect rows and how many of them are patched
    runs (an attribution-patching row that was only estimated is not)."""
    return _rows(warehouse, "SELECT sweep, count(DISTINCT pair_id) AS pairs, count(*) AS effect_rows, "
                            "count(effect) AS patched_runs FROM effects WHERE run_id = ? GROUP BY sweep "
                            "ORDER BY sweep", [run_id])


# Each sweep's cells on its headline metric (the `metric` its rows name), in each direction (clean
# into corrupt, and corrupt into clean where the sweep ran it), strongest first by what matters for the
# direction (warehouse.queries.strength_sql): denoising by mean recovery (1: the clean run restored),
# noising by 1 - mean recovery (0: the patch changed nothing), where the cell has a recovery; else (a
# metric without recovery, or spans too small) by the mean effect toward the clean run's value
# (denoising) or away from it (noising). `mean_of` says which mean is shown, `ranked_by` what ranks it;
# a cell with an interval (two pairs or more) before one without, so that one pair's cell does not head
# the list.
_BY_RECOVERY = "m.min_span IS NOT NULL AND s.n_recovery > 0"
_STRONGEST = f"""
WITH headline AS (
    SELECT sweep, arg_max(metric, n) AS metric
    FROM (SELECT sweep, metric, count(*) AS n FROM effects WHERE run_id = ? GROUP BY ALL) GROUP BY sweep
), judged AS (
    SELECT s.*, m.better, {_BY_RECOVERY} AS by_recovery,
           {strength_sql(_BY_RECOVERY, "s.mean_recovery", "s.mean_effect", "m.better")} AS strength,
           {ranked_by_sql(_BY_RECOVERY)} AS ranked_by
    FROM effect_summary s JOIN headline h USING (sweep, metric) JOIN metrics m USING (metric)
    WHERE s.run_id = ?
), valued AS (
    SELECT *, CASE WHEN by_recovery THEN 'recovery' ELSE 'effect' END AS mean_of,
           CASE WHEN by_recovery THEN mean_recovery ELSE mean_effect END AS mean,
           CASE WHEN by_recovery THEN ci95_low ELSE effect_ci95_low END AS low,
           CASE WHEN by_recovery THEN ci95_high ELSE effect_ci95_high END AS high
    FROM judged
), ranked AS (
    SELECT *, row_number() OVER (PARTITION BY sweep, direction ORDER BY by_recovery DESC, low IS NOT NULL DESC,
        strength DESC NULLS LAST, layer, position_role, head, neuron, sender, receiver) AS k
    FROM valued
)
SELECT sweep, site, direction, layer, position_role, head, neuron, sender, receiver, metric, n_pairs, mean_of, mean,
       low AS ci95_low, high AS ci95_high, ranked_by
FROM ranked WHERE k <= ? ORDER BY sweep, direction, k"""


def strongest(warehouse, run_id: str, per_sweep: int = STRONGEST_PER_SWEEP) -> list[dict]:
    """The strongest averaged cells of each sweep and direction (effect_summary), each with its
    metric, the mean (`mean_of`: recovery or effect), its 95% t interval, n_pairs and what ranked it
    (`ranked_by`: recovery, 1 - recovery, or the effect toward or away from the clean run's value)."""
    return _rows(warehouse, _STRONGEST, [run_id, run_id, int(per_sweep)])


def strongest_edges(warehouse, run_id: str, n: int = STRONGEST_PER_SWEEP) -> list[dict]:
    """The edges with the largest mean |score| (edge_summary), each with its mean score, t interval and
    n_pairs, and its method."""
    return _rows(warehouse, "SELECT method, sender, receiver, position_role, metric, n_pairs, mean_score, "
                            "score_ci95_low, score_ci95_high FROM edge_summary WHERE run_id = ? "
                            "ORDER BY mean_abs_score DESC, sender, receiver, position_role LIMIT ?", [run_id, int(n)])


def circuit_scores(warehouse, run_id: str) -> list[dict]:
    """The run's circuits judged (circuit_score: CPR and CMD per ablation), each with the faithfulness
    of its smallest and its 10% circuits (circuit_curve)."""
    return _rows(warehouse, "SELECT s.method, s.build, s.ablation, s.metric, s.n_sizes, s.cpr, s.cmd, "
                            "(SELECT c.faithfulness FROM circuit_curve c WHERE c.run_id = s.run_id AND "
                            "c.ablation = s.ablation AND c.metric = s.metric AND c.size = 10) AS faithfulness_10, "
                            "(SELECT max(c.n_pairs) FROM circuit_curve c WHERE c.run_id = s.run_id) AS n_pairs "
                            "FROM circuit_score s WHERE s.run_id = ? ORDER BY s.ablation, s.metric", [run_id])


def knockout_lows(warehouse, run_id: str) -> list[dict]:
    """Per group the last position was blocked from, the layer where blocking it lowered p(answer) most
    (knockout_curve: the mean relative change in percent over facts, its 95% t interval, n_pairs)."""
    return _rows(warehouse, "SELECT blocked, layer, \"window\", n_relative AS n_pairs, mean_relative_change_pct, "
                            "relative_change_ci95_low, relative_change_ci95_high FROM knockout_curve "
                            "WHERE run_id = ? AND metric = 'p' AND mean_relative_change_pct IS NOT NULL "
                            "QUALIFY row_number() OVER (PARTITION BY blocked ORDER BY mean_relative_change_pct, "
                            "layer) = 1 ORDER BY mean_relative_change_pct", [run_id])


def cell_name(cell: dict) -> str:
    """A cell in a few words: `resid L3 last`, `head L2.1 subject_last`, `head L1.0 -> logits all`."""
    unit = cell.get("head") if cell.get("head") is not None else cell.get("neuron")
    where = "" if cell.get("layer") is None else f" L{cell['layer']}" + ("" if unit is None else f".{unit}")
    to = f" -> {cell['receiver']}" if cell.get("receiver") else ""
    noise = "" if cell.get("direction") in (None, "denoise") else f" ({cell['direction']})"
    return f"{cell['site']}{where}{to} {cell.get('position_role') or 'all'}{noise}"


def run_state(warehouse, run_id: str) -> dict:
    """The run's label (its `name` setting, or None), model, status, reason and seconds from start to
    finish (None while it runs)."""
    rows = _rows(warehouse, "SELECT params ->> 'name' AS name, model, status, reason, date_diff('millisecond', "
                            "started, finished) / 1000.0 AS seconds FROM runs WHERE run_id = ?", [run_id])
    if not rows:
        raise ValueError(f"warehouse {warehouse}: no run {run_id}")
    return rows[0]


def commands(warehouse, run_id: str, report_dir: str = "report") -> dict:
    """The commands that read the run: its strongest denoising cells in SQL, and its HTML report."""
    sql = (f"SELECT * FROM effect_summary WHERE run_id = '{run_id}' AND direction = 'denoise' "
           f"ORDER BY mean_recovery DESC NULLS LAST LIMIT 20")
    return {"query": shell_command("patchgrid", "query", "--warehouse", str(warehouse), sql),
            "report": shell_command("patchgrid", "report", "--warehouse", str(warehouse), "--run", run_id,
                                    "--out", report_dir)}


def study_summary(warehouse: str | Path, run_id: str, per_sweep: int = STRONGEST_PER_SWEEP) -> dict:
    """Everything the study's summary says, as one JSON-ready dict."""
    state = run_state(warehouse, run_id)
    return {"run_id": run_id, "name": state["name"], "warehouse": str(warehouse), "model": state["model"],
            "status": state["status"],
            "seconds": None if state["seconds"] is None else float(state["seconds"]),
            "records": records(warehouse, run_id), "sweeps": sweeps(warehouse, run_id),
            "strongest": [{**c, "cell": cell_name(c)} for c in strongest(warehouse, run_id, per_sweep)],
            "strongest_edges": strongest_edges(warehouse, run_id, per_sweep),
            "circuits": circuit_scores(warehouse, run_id),
            "knockouts": knockout_lows(warehouse, run_id),
            "commands": commands(warehouse, run_id)}
