from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact

from patchgrid.pipeline import steps
from patchgrid.pipeline.spec import StudySpec


@task
def record_run(spec: StudySpec, flow_run_id: str, model_sha256: str, started, measured: dict | None = None) -> None:
    """The run, as running (patchgrid.pipeline.steps.start_run_record); `measured`: what the run derived
    from its inputs (the trace noise), recorded beside its parameters."""
    steps.start_run_record(spec.warehouse, spec.run_id, spec.model, model_sha256,
                           {**spec.recorded_params(), **(measured or {})}, started, flow_run_id)


@task(retries=2, retry_delay_seconds=2)
def load_warehouse(spec: StudySpec, pairs_table: str, baseline_files: list[str], effect_files: list[str],
                   finished, status: str = "completed") -> dict:
    """Load the run's staged pairs, baselines and effects in one transaction (replacing, never duplicating),
    and record the run as `status` (a run that stops with no pairs to sweep: `failed`, its records loaded):
    patchgrid.pipeline.steps.load."""
    counts = steps.load(spec.warehouse, spec.run_id, pairs_table, steps.read_baselines(baseline_files), effect_files,
                        finished=finished, status=status)
    get_run_logger().info("warehouse %s: loaded %s", spec.warehouse, counts)
    return counts


@task
def summarize(spec: StudySpec, top: int = 20) -> list[dict]:
    """The run's strongest averaged cells (patchgrid.warehouse.queries.strongest_effects), as a table artifact."""
    from patchgrid.warehouse.queries import strongest_effects

    cols, rows = strongest_effects(spec.warehouse, spec.run_id, top)
    table = [dict(zip(cols, r)) for r in rows]
    create_table_artifact(key="study-summary", table=table,
                          description=f"The {top} strongest averaged cells of run {spec.run_id} (denoising by mean "
                                      f"recovery, noising by 1 - mean recovery: ranked_by)")
    return table
