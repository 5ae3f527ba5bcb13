"""Shards on a Ray cluster: each engine lives in a Ray actor and serves shard after shard.

The study flow submits one Prefect task per shard through prefect-ray's RayTaskRunner; the task
hands its shard to the actor it is assigned (shard k -> actor k mod n), so a worker's vLLM engine
starts once and is reused, and GPUs per engine are the actor's resource request.
"""
from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from patchgrid.spec import ShardSpec, StudySpec

from .keys import engine_inputs, keyed_by


def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=1)
    class EngineActor:
        """One engine, kept alive across shards."""

        def __init__(self, model: str, backend: str, engine_options: dict):
            from patchgrid.engine import load_engine

            self.engine = load_engine(model, backend, **engine_options)
            self.shards = 0

        def sweep(self, shard: ShardSpec) -> tuple[int, int, int]:
            import os

            from patchgrid.shards import compute_shard

            n = compute_shard(self.engine, shard)
            self.shards += 1
            return n, self.shards, os.getpid()

        def pid(self) -> int:
            import os

            return os.getpid()

    return EngineActor


def actor_name(model_sha256: str, backend: str, slot: int) -> str:
    return f"patchgrid-{model_sha256[:12]}-{backend}-{slot}"


def get_actor(spec: StudySpec, model_sha256: str, slot: int):
    return _actor_class().options(name=actor_name(model_sha256, spec.backend, slot), namespace="patchgrid",
                                  get_if_exists=True, num_gpus=spec.gpus_per_engine,
                                  # outlive the task that started it: the next shards reuse its engine
                                  lifetime="detached").remote(spec.model, spec.backend, spec.engine_options())


@task(cache_key_fn=keyed_by(engine_inputs), persist_result=True, retries=2, retry_delay_seconds=1)
def sweep_shard_on_ray(spec: StudySpec, shard: ShardSpec, model_sha256: str, slot: int = 0) -> str:
    """Run one shard in the engine actor of its slot; return its effects file (written by the actor)."""
    import ray

    logger = get_run_logger()
    if Path(shard.out).is_file():
        logger.info("shard %s already done", shard.out)
        return shard.out
    n, served, pid = ray.get(get_actor(spec, model_sha256, slot).sweep.remote(shard))
    # provenance: which engine computed this shard, and how many it had served by then
    Path(shard.out + ".engine.json").write_text(json.dumps({"slot": slot, "actor_pid": pid, "served": served}))
    logger.info("shard of %d pairs: %d effect rows -> %s (engine actor %d, pid %d, its shard #%d)", len(shard.pairs),
                n, shard.out, slot, pid, served)
    return shard.out


@task
def release_actors(spec: StudySpec, model_sha256: str) -> None:
    """Engines hold memory (and GPUs): free them when the study is done."""
    import ray

    for slot in range(spec.ray_workers):
        try:
            ray.kill(ray.get_actor(actor_name(model_sha256, spec.backend, slot), namespace="patchgrid"))
        except ValueError:  # never started
            pass
