"""The `study` flow: data set -> aligned pairs -> clean-activation cache -> sweeps over shards of
pairs -> DuckDB warehouse -> summary. Each step is a task in patchgrid.tasks; this file only
orchestrates.

    python -m patchgrid.flows.study          # the demo study, no Prefect server needed
"""
from __future__ import annotations

import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.runtime import flow_run

from patchgrid.tasks.cache import cache_activations
from patchgrid.tasks.engines import close_all
from patchgrid.tasks.pairs import align_pairs
from patchgrid.tasks.sweeps import sweep_shard
from patchgrid.tasks.warehouse import load_warehouse, record_run, summarize

SHIPPED_PAIRS = str(Path(__file__).resolve().parents[1] / "data" / "pairs" / "facts.jsonl")
RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
RUNNERS = ("local", "ray")


def validate(sweeps, limit, shard_size, trace_samples, backend, run_id, runner="local", ray_workers=1,
             gpus_per_engine=0.0, tensor_parallel_size=1):
    """Flow parameters are the edge: check them here, pass plain values on."""
    from patchgrid.sweeps import SweepConfig

    names = [s.strip() for s in (sweeps.split(",") if isinstance(sweeps, str) else sweeps) if s.strip()]
    SweepConfig(sweeps=tuple(names), trace_samples=trace_samples)  # raises ValueError naming the problem
    if limit is not None and limit < 1:
        raise ValueError(f"limit {limit} must be at least 1")
    if shard_size < 1:
        raise ValueError(f"shard_size {shard_size} must be at least 1")
    if backend not in ("vllm", "hf"):
        raise ValueError(f"backend {backend!r} is not vllm or hf")
    if runner not in RUNNERS:
        raise ValueError(f"runner {runner!r} is not one of {', '.join(RUNNERS)}")
    if ray_workers < 1:
        raise ValueError(f"ray_workers {ray_workers} must be at least 1")
    if gpus_per_engine < 0:
        raise ValueError(f"gpus_per_engine {gpus_per_engine} must not be negative")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} must be at least 1")
    if tensor_parallel_size > 1 and runner != "ray":
        raise ValueError("tensor_parallel_size > 1 runs in Ray engine actors: use runner ray")
    if run_id is not None and not RUN_ID.match(run_id):
        raise ValueError(f"run_id {run_id!r} may hold only letters, digits, '.', '_' and '-' (64 at most)")
    return names


def code_version() -> str:
    import patchgrid

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{patchgrid.__version__}+{rev}" if rev else patchgrid.__version__


def _produced(task, *args, **kwargs) -> str:
    """Run a task whose result is a path; a cached result whose file is gone is computed again."""
    path = task(*args, **kwargs)
    if not Path(path).exists():
        path = task.with_options(refresh_cache=True)(*args, **kwargs)
    return path


@flow(name="study", log_prints=True)
def study(model: str = "smollm2-135m", pairs: str = SHIPPED_PAIRS, sweeps: str = "resid,attn_out,mlp_out,heads",
          limit: int | None = None, warehouse: str = "warehouse.duckdb", workdir: str = ".patchgrid",
          pairs_format: str | None = None, require_known: bool = True, seed: int = 0, trace_samples: int = 10,
          shard_size: int = 8, backend: str = "vllm", max_requests: int = 2048, run_id: str | None = None,
          runner: str = "local", ray_address: str | None = None, ray_workers: int = 2, gpus_per_engine: float = 0.0,
          tensor_parallel_size: int = 1) -> str:
    """Run a whole activation-patching study and load it into the warehouse; returns the run id."""
    from patchgrid.cache import ActivationCache, model_identity
    from patchgrid.fingerprint import fingerprint
    from patchgrid.models import prepare
    from patchgrid.pairs import accepted_pairs, read_pairs
    from patchgrid.sweeps import trace_noise_std

    logger = get_run_logger()
    names = validate(sweeps, limit, shard_size, trace_samples, backend, run_id, runner, ray_workers, gpus_per_engine,
                     tensor_parallel_size)
    folder = prepare(model)
    model_sha = model_identity(folder)["weights_sha256"]
    params = dict(model=model, pairs=pairs, sweeps=names, limit=limit, pairs_format=pairs_format,
                  require_known=require_known, seed=seed, trace_samples=trace_samples, backend=backend)
    # The same inputs give the same run id: a rerun resumes and replaces, never duplicates.
    run_id = run_id or "run-" + fingerprint(model_sha, params)[:12]
    work = Path(workdir).resolve()
    run_dir = work / "runs" / run_id
    started = datetime.now(timezone.utc).replace(tzinfo=None)
    record_run(warehouse, {"run_id": run_id, "flow_run_id": str(flow_run.get_id() or ""), "model": model,
                           "model_hash": model_sha, "params": params, "code_version": code_version(),
                           "started": started})
    logger.info("run %s: model %s, pairs %s, sweeps %s", run_id, model, pairs, ",".join(names))
    try:
        table = _produced(align_pairs, model, pairs, str(run_dir / "pairs.parquet"), pairs_format=pairs_format,
                          require_known=require_known, seed=seed, backend=backend, model_sha256=model_sha)
        cache_folder = _produced(cache_activations, model, table, str(work / "cache"), names, limit, trace_samples,
                                 backend=backend, model_sha256=model_sha)
        accepted = accepted_pairs(read_pairs(table), limit)
        if not accepted:
            raise ValueError(f"no accepted pairs in {pairs}: see the rejections in {table}")
        noise_std = 0.0
        if "trace" in names:
            noise_std = trace_noise_std(ActivationCache(Path(cache_folder)), accepted, 3.0)
        shards = [accepted[k:k + shard_size] for k in range(0, len(accepted), shard_size)]
        shard_args = [dict(model=model, pairs_table=table, cache_folder=cache_folder,
                           pair_ids=[p.pair_id for p in shard], out=str(run_dir / "effects" / f"shard-{k:05d}.parquet"),
                           sweeps=names, trace_samples=trace_samples, seed=seed, noise_std=noise_std,
                           max_requests=max_requests, backend=backend, model_sha256=model_sha)
                      for k, shard in enumerate(shards)]
        if runner == "ray":
            close_all()  # the shards' engines live in Ray actors; free this process's engine
            effect_files = sweep_shards_on_ray_with(ray_address, shard_args, ray_workers, gpus_per_engine,
                                                    tensor_parallel_size, run_id)
        else:
            progress = create_progress_artifact(progress=0.0, key=f"sweeps-{run_id}".lower(),
                                                description=f"Sweeps of run {run_id}: shards done")
            effect_files = []
            for k, kwargs in enumerate(shard_args):
                effect_files.append(_produced(sweep_shard, **kwargs))
                update_progress_artifact(progress, progress=100.0 * (k + 1) / len(shards))
        finished = datetime.now(timezone.utc).replace(tzinfo=None)
        load_warehouse(warehouse, run_id, table, cache_folder, effect_files, finished)
        top = summarize(warehouse, run_id)
        logger.info("run %s done: %d pairs in %d shards; strongest: %s", run_id, len(accepted), len(shards),
                    top[:1])
    finally:
        close_all()
    return run_id


@flow(name="study-shards-on-ray")
def sweep_shards_on_ray(shard_args: list[dict], ray_workers: int, gpus_per_engine: float, tensor_parallel_size: int,
                        run_id: str) -> list[str]:
    """Every shard as a Ray task; shard k goes to engine actor k mod ray_workers."""
    from patchgrid.tasks.ray_engines import release_actors, sweep_shard_on_ray

    progress = create_progress_artifact(progress=0.0, key=f"sweeps-{run_id}".lower(),
                                        description=f"Sweeps of run {run_id} on Ray: shards done")
    def submit(kwargs, k, refresh=False):
        task = sweep_shard_on_ray.with_options(refresh_cache=True) if refresh else sweep_shard_on_ray
        return task.submit(**kwargs, slot=k % ray_workers, gpus_per_engine=gpus_per_engine,
                           tensor_parallel_size=tensor_parallel_size)

    futures = [submit(kwargs, k) for k, kwargs in enumerate(shard_args)]
    paths = []
    for k, future in enumerate(futures):
        path = future.result()
        if not Path(path).is_file():  # a cached result whose file was removed: compute it again
            path = submit(shard_args[k], k, refresh=True).result()
        paths.append(path)
        update_progress_artifact(progress, progress=100.0 * (k + 1) / len(futures))
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise RuntimeError(f"{len(missing)} shard files are not visible here (is the work folder shared with the "
                           f"Ray workers?): {missing[0]}")
    release_actors(shard_args[0]["model_sha256"], shard_args[0]["backend"], ray_workers)
    return paths


def sweep_shards_on_ray_with(address, shard_args, ray_workers, gpus_per_engine, tensor_parallel_size, run_id):
    from prefect.client.orchestration import get_client
    from prefect_ray import RayTaskRunner

    # Ray's workers report task states to this flow's Prefect API: hand them its address (in
    # ephemeral mode a loopback server this process started; a cluster needs a server it can reach).
    api = str(get_client().api_url).rstrip("/")
    init = {"runtime_env": {"env_vars": {"PREFECT_API_URL": api}}}
    if address is None:  # a local Ray this flow starts: small, no dashboard
        init.update(include_dashboard=False, object_store_memory=256 * 1024 * 1024)
    runner = RayTaskRunner(address=address, init_kwargs=init)
    return sweep_shards_on_ray.with_options(task_runner=runner)(shard_args, ray_workers, gpus_per_engine,
                                                                 tensor_parallel_size, run_id)


if __name__ == "__main__":
    print(study(limit=8))
