"""The sweeps step and the trace noise as Prefect tasks: cached, retried, logged."""
from __future__ import annotations

from prefect import get_run_logger, task

from patchgrid.backends.engine import Engines
from patchgrid.pipeline import steps
from patchgrid.pipeline.spec import ShardSpec, StudySpec
from patchgrid.pipeline.steps import noise_inputs

from .keys import engine_inputs, keyed_by


@task(cache_key_fn=keyed_by(engine_inputs), persist_result=True, retries=2, retry_delay_seconds=1)
def sweep_shard(spec: StudySpec, shard: ShardSpec, model_sha256: str, engines: Engines) -> str:
    """Run every sweep over one shard of pairs where the engines run (patchgrid.pipeline.steps.sweep_shard);
    return its effects file."""
    n = steps.sweep_shard(shard, engines)
    if n is None:
        get_run_logger().info("shard %s already done", shard.out)
    else:
        get_run_logger().info("shard of %d pairs: %d effect rows -> %s", len(shard.pairs), n, shard.out)
    return shard.out


@task(cache_key_fn=keyed_by(noise_inputs), persist_result=True)
def measure_trace_noise(spec: StudySpec, model_sha256: str):
    """The causal-tracing noise for this data set and model (trace_noise_scale, by default 3, x the
    std of its subjects' token embeddings), the same whatever pairs a study keeps."""
    v = noise_inputs(spec)
    noise = steps.trace_noise(v["model"], steps.data_set_subjects(v["source"], v["fmt"]), v["scale"])
    get_run_logger().info("trace noise: %.4f (%s)", noise.std, noise.source)
    return noise
