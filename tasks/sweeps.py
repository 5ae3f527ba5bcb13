from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from patchgrid.backends.engine import Engines, using_engine
from patchgrid.pipeline.spec import ShardSpec, StudySpec

from .keys import engine_inputs, keyed_by


@task(cache_key_fn=keyed_by(engine_inputs), persist_result=True, retries=2, retry_delay_seconds=1)
def sweep_shard(spec: StudySpec, shard: ShardSpec, model_sha256: str, engines: Engines) -> str:
    """Run every sweep over one shard of pairs where the engines run; return its effects file (its
    engine's provenance beside it, for a shard run in an engine actor)."""
    from patchgrid.pipeline.shards import compute_shard
    from patchgrid.runtime.progress import stage

    logger = get_run_logger()
    if Path(shard.out).is_file():  # written whole (rename) by an earlier attempt of this same shard
        logger.info("shard %s already done", shard.out)
        return shard.out
    # a shard run in an engine actor reports nothing there: the flow counts shards done (sweep_shards_on_ray)
    progress = stage(f"patched runs ({Path(shard.out).stem})")
    n = engines.run(using_engine(compute_shard, shard=shard, progress=progress), provenance=shard.out + ".engine.json")
    logger.info("shard of %d pairs: %d effect rows -> %s", len(shard.pairs), n, shard.out)
    return shard.out


def noise_inputs(spec: StudySpec) -> dict:
    """What the trace noise depends on: the model's embeddings of the data set's subjects, and its scale."""
    return dict(model=spec.model, source=spec.pairs, fmt=spec.pairs_format, scale=spec.sweep.trace_noise_scale)


@task(cache_key_fn=keyed_by(noise_inputs), persist_result=True)
def measure_trace_noise(spec: StudySpec, model_sha256: str):
    """The causal-tracing noise for this data set and model (trace_noise_scale, by default 3, x the
    std of its subjects' token embeddings), the same whatever pairs a study keeps. It reads the
    embedding matrix from the weight files; no model is loaded."""
    from patchgrid.model.models import prepare
    from patchgrid.pairs import read_source
    from patchgrid.sweeps import subject_noise

    v = noise_inputs(spec)
    _, records = read_source(v["source"], v["fmt"])
    noise = subject_noise(prepare(v["model"]), [r.subject for r in records], v["scale"])
    get_run_logger().info("trace noise: %.4f (%s)", noise.std, noise.source)
    return noise
