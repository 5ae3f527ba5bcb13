"""The pairs step as a Prefect task: cached by what the pairs table depends on, retried, logged."""
from __future__ import annotations

from prefect import get_run_logger, task

from patchgrid.backends.engine import Engines
from patchgrid.pipeline.spec import StudySpec
from patchgrid.pipeline.steps import pairing_inputs, write_pairs_table

from .keys import keyed_by


@task(cache_key_fn=keyed_by(pairing_inputs), persist_result=True, retries=2, retry_delay_seconds=1)
def align_pairs(spec: StudySpec, model_sha256: str, out: str, engines: Engines) -> str:
    """Read the data set, pair and align it with the model's tokenizer; write the pairs table
    (patchgrid.pipeline.steps.write_pairs_table). Where the model is asked, that runs where the
    engines run."""
    made = write_pairs_table(pairing_inputs(spec), out, engines)
    counts = ", ".join(f"{status}{'/' + reason if reason else ''}: {n}" for (status, reason), n in made.counts.items())
    get_run_logger().info("%s: %d records (format %s; %s) -> %s", spec.pairs, made.records, made.fmt, counts, out)
    return out
