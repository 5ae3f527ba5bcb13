from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact


@task
def record_run(warehouse: str, run: dict) -> None:
    from patchgrid.warehouse.loader import start_run

    start_run(warehouse, run)


@task(retries=2, retry_delay_seconds=2)
def load_warehouse(warehouse: str, run_id: str, pairs_table: str, cache_folder: str, effect_files: list[str],
                   finished) -> dict:
    """Load the run's pairs, baselines and effects in one transaction (replacing, never duplicating)."""
    from patchgrid.cache import ActivationCache
    from patchgrid.pairs import read_pairs
    from patchgrid.warehouse.loader import load_run

    cache = ActivationCache(cache_folder)
    counts = load_run(warehouse, run_id, read_pairs(pairs_table), list(cache.baselines.values()), effect_files,
                      finished=finished)
    get_run_logger().info("warehouse %s: loaded %s", warehouse, counts)
    return counts


@task
def summarize(warehouse: str, run_id: str, top: int = 20) -> list[dict]:
    """The run's strongest averaged effects, as a table artifact."""
    from patchgrid.warehouse.loader import query

    cols, rows = query(warehouse, """
        SELECT sweep, site, direction, layer, position_role, head, n_pairs,
               round(mean_recovery, 3) AS mean_recovery, round(ci95_low, 3) AS ci95_low,
               round(ci95_high, 3) AS ci95_high
        FROM effect_summary WHERE run_id = ? AND sweep <> 'trace'
        ORDER BY mean_recovery DESC NULLS LAST LIMIT ?""", [run_id, int(top)])
    table = [dict(zip(cols, r)) for r in rows]
    create_table_artifact(key="study-summary", table=table,
                          description=f"Top {top} averaged recoveries of run {run_id}")
    return table
