from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from patchgrid.pipeline.spec import StudySpec


@task
def record_run(spec: StudySpec, flow_run_id: str, model_sha256: str, code_version: str, started,
               measured: dict | None = None) -> None:
    """The run, as running; `measured`: what the run derived from its inputs (the trace noise),
    recorded beside its parameters."""
    from patchgrid.warehouse.loader import start_run

    start_run(spec.warehouse, {"run_id": spec.run_id, "flow_run_id": flow_run_id, "model": spec.model,
                               "model_hash": model_sha256, "params": {**spec.recorded_params(), **(measured or {})},
                               "code_version": code_version, "started": started})


@task(retries=2, retry_delay_seconds=2)
def load_warehouse(spec: StudySpec, pairs_table: str, baseline_files: list[str], effect_files: list[str],
                   finished, status: str = "completed") -> dict:
    """Load the run's staged pairs, baselines and effects in one transaction (replacing, never duplicating),
    and record the run as `status` (a run that stops with no pairs to sweep: `failed`, its records loaded)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from patchgrid.pairs import read_pairs
    from patchgrid.rows.shapes import BASELINE
    from patchgrid.runtime.progress import stage
    from patchgrid.sweeps import SWEEP_KINDS
    from patchgrid.warehouse.loader import load_run

    baselines = (pa.concat_tables([pq.read_table(f, schema=BASELINE.schema) for f in baseline_files])
                 if baseline_files else BASELINE.table([]))
    # how each kind is drawn, so that the views select its rows by their shape, never by its name
    kinds = {name: kind.drawing for name, kind in SWEEP_KINDS.items()}
    counts = load_run(spec.warehouse, spec.run_id, read_pairs(pairs_table), baselines, effect_files,
                      finished=finished, status=status, sweep_kinds=kinds,
                      progress=stage("warehouse load (files)"))
    get_run_logger().info("warehouse %s: loaded %s", spec.warehouse, counts)
    return counts


@task
def summarize(spec: StudySpec, top: int = 20) -> list[dict]:
    """The run's strongest averaged effects, as a table artifact."""
    from patchgrid.warehouse.queries import strongest_effects

    cols, rows = strongest_effects(spec.warehouse, spec.run_id, top)
    table = [dict(zip(cols, r)) for r in rows]
    create_table_artifact(key="study-summary", table=table,
                          description=f"Top {top} averaged recoveries of run {spec.run_id}")
    return table
