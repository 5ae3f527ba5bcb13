"""Shards on a Ray cluster: each engine lives in a Ray actor and serves shard after shard.

The study flow submits one Prefect task per shard through prefect-ray's RayTaskRunner; the task
hands its shard to the actor it is assigned (shard k -> actor k mod n), so a worker's vLLM engine
starts once and is reused, and GPUs per engine are the actor's resource request.
"""
from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger, task

from .keys import inputs_key


def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=1)
    class EngineActor:
        """One engine, kept alive across shards."""

        def __init__(self, model: str, backend: str, engine_options: dict):
            from patchgrid.engine import load_engine

            self.engine = load_engine(model, backend, **engine_options)
            self.shards = 0

        def sweep(self, *args) -> tuple[int, int, int]:
            import os

            from .sweeps import compute_shard

            n = compute_shard(self.engine, *args)
            self.shards += 1
            return n, self.shards, os.getpid()

        def pid(self) -> int:
            import os

            return os.getpid()

    return EngineActor


def actor_name(model_sha256: str, backend: str, slot: int) -> str:
    return f"patchgrid-{model_sha256[:12]}-{backend}-{slot}"


def get_actor(model: str, backend: str, model_sha256: str, slot: int, gpus_per_engine: float,
              tensor_parallel_size: int):
    options = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}
    return _actor_class().options(name=actor_name(model_sha256, backend, slot), namespace="patchgrid",
                                  get_if_exists=True, num_gpus=gpus_per_engine,
                                  # outlive the task that started it: the next shards reuse its engine
                                  lifetime="detached").remote(model, backend, options)


@task(cache_key_fn=inputs_key, persist_result=True, retries=2, retry_delay_seconds=1)
def sweep_shard_on_ray(model: str, pairs_table: str, cache_folder: str, pair_ids: list[str], out: str,
                       sweeps: list[str], trace_samples: int, seed: int, noise_std: float, max_requests: int = 2048,
                       backend: str = "vllm", model_sha256: str = "", slot: int = 0, gpus_per_engine: float = 0.0,
                       tensor_parallel_size: int = 1) -> str:
    """Run one shard in the engine actor of its slot; return the Parquet path (written by the actor)."""
    import ray

    logger = get_run_logger()
    if Path(out).is_file():
        logger.info("shard %s already done", out)
        return out
    actor = get_actor(model, backend, model_sha256, slot, gpus_per_engine, tensor_parallel_size)
    n, served, pid = ray.get(actor.sweep.remote(pairs_table, cache_folder, pair_ids, out, sweeps, trace_samples,
                                                seed, noise_std, max_requests))
    # provenance: which engine computed this shard, and how many it had served by then
    Path(out + ".engine.json").write_text(json.dumps({"slot": slot, "actor_pid": pid, "served": served}))
    logger.info("shard of %d pairs: %d effect rows -> %s (engine actor %d, pid %d, its shard #%d)", len(pair_ids), n,
                out, slot, pid, served)
    return out


@task
def release_actors(model_sha256: str, backend: str, n: int) -> None:
    """Engines hold memory (and GPUs): free them when the study is done."""
    import ray

    for slot in range(n):
        try:
            ray.kill(ray.get_actor(actor_name(model_sha256, backend, slot), namespace="patchgrid"))
        except ValueError:  # never started
            pass
