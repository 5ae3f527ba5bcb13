from __future__ import annotations

import os

from prefect import get_run_logger, task

from patchgrid.engine import EnginePool
from patchgrid.spec import ShardSpec, StudySpec

from .keys import keyed_on


@task(cache_key_fn=keyed_on("model", "backend"), persist_result=True, retries=2, retry_delay_seconds=1)
def sweep_shard(spec: StudySpec, shard: ShardSpec, model_sha256: str, engines: EnginePool) -> str:
    """Run every sweep over one shard of pairs in this process's engine; return its effects file."""
    from pathlib import Path

    from patchgrid.progress import report
    from patchgrid.shards import compute_shard

    logger = get_run_logger()
    if Path(shard.out).is_file():  # written whole (rename) by an earlier attempt of this same shard
        logger.info("shard %s already done", shard.out)
        return shard.out
    try:
        n = compute_shard(engines.get(spec.model, spec.backend), shard, report)
    except Exception:
        engines.drop(spec.model, spec.backend)  # a retry starts a fresh engine
        raise
    logger.info("shard of %d pairs: %d effect rows -> %s (pid %d)", len(shard.pairs), n, shard.out, os.getpid())
    return shard.out


@task(cache_key_fn=keyed_on("model", "pairs", "pairs_format"), persist_result=True)
def measure_trace_noise(spec: StudySpec, model_sha256: str):
    """The causal-tracing noise for this data set and model (3 x the std of its subjects' token
    embeddings), the same whatever pairs a study keeps."""
    from patchgrid.models import prepare
    from patchgrid.pairs import read_source
    from patchgrid.sweeps import TRACE_NOISE_SCALE, subject_noise

    _, records = read_source(spec.pairs, spec.pairs_format)
    noise = subject_noise(prepare(spec.model), [r.subject for r in records], TRACE_NOISE_SCALE)
    get_run_logger().info("trace noise: %.4f (%s)", noise.std, noise.source)
    return noise
