"""The `study` flow: data set -> aligned pairs -> clean-activation cache -> sweeps over shards of
pairs -> DuckDB warehouse -> summary. Each step is a plain function of patchgrid.pipeline.steps
(which `patchgrid sweep` calls directly), run here as a task of patchgrid.tasks where Prefect's
caching, retries or artifacts serve it; this file only orchestrates. Its one parameter is the
study's StudySpec, validated when it is built, and handed to every task.

    python -m patchgrid.flows.study          # the demo study, no Prefect server needed

No `from __future__ import annotations` here: Prefect builds the flow's parameter model from its
annotations, and a flow loaded from its entrypoint (a served or deployed run) cannot resolve them
as strings.
"""

from functools import partial
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from patchgrid.backends.engine import Engines, LocalEngines
from patchgrid.pipeline import steps
from patchgrid.pipeline.spec import ShardSpec, StudySpec
from patchgrid.runtime.progress import report
from patchgrid.runtime.stopping import Cancelled, cancel_on_signals, one_line, signalled
from patchgrid.tasks.cache import cache_activations
from patchgrid.tasks.pairs import align_pairs
from patchgrid.tasks.sweeps import measure_trace_noise, sweep_shard
from patchgrid.tasks.warehouse import load_warehouse, record_run, summarize

DEFAULT = StudySpec()


def _produced(task, *args, sound=lambda path: Path(path).exists(), **kwargs) -> str:
    """Run a task whose result is a path; a cached result whose file is gone (or not `sound`) is
    computed again."""
    path = task(*args, **kwargs)
    if not sound(path):
        path = task.with_options(refresh_cache=True)(*args, **kwargs)
    return path


@flow(name="study", log_prints=True)
def study(spec: StudySpec = DEFAULT) -> str:
    """Run a whole activation-patching study and load it into the warehouse; returns the run id.
    `spec`: every setting of the study (patchgrid.pipeline.spec.StudySpec; Prefect validates it, and a
    deployment's parameters nest its fields under `spec`, the sweeps' under `spec.sweep`)."""
    # SIGTERM and SIGINT stop the study through every clean-up on the way out (engines first)
    with cancel_on_signals():
        return run_study(spec)


def engines_for(spec: StudySpec, model_sha: str) -> Engines:
    """Where the study's model work runs: this process's engine, or the run's engine actors on Ray."""
    from patchgrid.pipeline.memory import describe, gpu_memory, memory_plan, study_engine_options

    log = get_run_logger().info
    if spec.runner != "ray":
        plan = memory_plan(spec, gpu_memory())  # a study with atp: engine and gradient model on one device
        if plan is not None:
            log(describe(plan))
        return LocalEngines(spec.model, spec.backend, study_engine_options(spec))
    from patchgrid.backends.cluster import RayEngines

    # the engines' options are worked out in each actor, against the GPU it is given (the atp plan)
    return RayEngines(spec.run_id, spec.model, model_sha, spec.backend, steps.code_version(),
                      workers=spec.ray_workers, tensor_parallel_size=spec.tensor_parallel_size,
                      gpus=spec.gpus_per_engine, options=partial(study_engine_options, spec), address=spec.ray_address,
                      timeout_s=spec.ray_timeout_s, log=log)


def run_study(spec: StudySpec) -> str:
    from patchgrid.sweeps import TraceNoise, noised
    from patchgrid.warehouse.loader import finish_run

    steps.check_model(spec.model, spec.sweep)  # before the run starts, from the flow or the API too
    model_sha = steps.model_sha256(spec.model)
    # The same inputs give the same run id: a rerun resumes and replaces, never duplicates.
    spec = spec.with_run_id(spec.run_id or spec.default_run_id(model_sha))
    noise = None
    if noised(spec.sweeps):  # a kind whose runs add noise: its std is set over the whole data set
        noise = (TraceNoise(spec.trace_noise, "--trace-noise") if spec.trace_noise is not None
                 else measure_trace_noise(spec, model_sha))
    record_run(spec, str(flow_run.get_id() or ""), model_sha, steps.now(), steps.measured(noise, spec.sweeps))
    try:
        # the engines (this process's, or the run's actors) are released however the run ends
        with engines_for(spec, model_sha) as engines:
            return _sweep_and_load(spec, engines, model_sha, noise.std if noise else 0.0)
    except BaseException as exc:
        # a run that stops says why, in the warehouse, rather than staying `running` for ever
        status = "cancelled" if isinstance(exc, (Cancelled, KeyboardInterrupt)) or signalled() else "failed"
        finish_run(spec.warehouse, spec.run_id, status, finished=steps.now(), reason=one_line(exc))
        raise


def _sweep_and_load(spec: StudySpec, engines: Engines, model_sha: str, noise_std: float) -> str:
    from patchgrid.pairs import read_pairs
    from patchgrid.sweeps import POPULATIONS
    from patchgrid.sweeps.populations import nothing_to_run

    logger = get_run_logger()
    work = Path(spec.workdir).resolve()
    run_dir = work / "runs" / spec.run_id
    logger.info("run %s: model %s, pairs %s, sweeps %s", spec.run_id, spec.model, spec.pairs, ",".join(spec.sweeps))
    table = _produced(align_pairs, spec, model_sha, str(run_dir / "pairs.parquet"), engines)
    # each group of sweep kinds runs on its own population (accepted pairs; the facts the model
    # knows alone, partner or not, for causal tracing): every population is chosen before any work
    groups = steps.groups(read_pairs(table), spec.sweep, spec.limit)
    empty = steps.first_empty(groups)
    if empty is not None:  # the run's records still reach its pairs and rejections views, then it stops
        load_warehouse(spec, table, [], [], steps.now(), status="failed")
        raise ValueError(nothing_to_run(empty.population, read_pairs(table), spec.pairs, spec.warehouse, spec.run_id,
                                        spec.sweep))
    shards = []
    for group in groups:
        std = group.noise_std(noise_std)
        # a cache folder damaged since it was written is found by its checksums, and rebuilt
        folder = _produced(cache_activations, spec, group.members, str(work / "cache"), model_sha, engines,
                           group.names, std, sound=steps.cache_is_sound)
        shards += steps.shards_of(group, folder, std, run_dir / "effects", spec.shard_size, first=len(shards),
                                  attribution=spec.attribution_options())
    if spec.runner == "ray":
        effect_files = sweep_shards_on_ray(spec, shards, model_sha, engines)
    else:
        progress = create_progress_artifact(progress=0.0, key=f"sweeps-{spec.run_id}".lower(),
                                            description=f"Sweeps of run {spec.run_id}: shards done")
        effect_files = []
        for k, shard in enumerate(shards):
            effect_files.append(_produced(sweep_shard, spec, shard, model_sha, engines))
            update_progress_artifact(progress, progress=100.0 * (k + 1) / len(shards))
    load_warehouse(spec, table, [s.baselines_out for s in shards if s.writes_baselines], effect_files, steps.now())
    top = summarize(spec)
    chosen = {group.population: len(group.members) for group in groups}
    logger.info("run %s done: %s, in %d shards; strongest: %s", spec.run_id,
                ", ".join(f"{chosen.get(p, 0)} {p.counted_as}" for p in POPULATIONS), len(shards), top[:1])
    return spec.run_id


def sweep_shards_on_ray(spec: StudySpec, shards: list[ShardSpec], model_sha256: str, engines: Engines) -> list[str]:
    """Every shard as a task of its own, as many at once as there are engine actors: each goes to the
    next actor that is free (patchgrid.backends.cluster.RayEngines), so a slow node holds only its own shard."""
    progress = create_progress_artifact(progress=0.0, key=f"sweeps-{spec.run_id}".lower(),
                                        description=f"Sweeps of run {spec.run_id} on Ray: shards done")
    # the shards' patched runs are counted in the actors, where nobody listens: the caller is told shards done
    report("shards on Ray", 0, len(shards))
    with ThreadPoolTaskRunner(max_workers=spec.ray_workers) as runner:
        futures = [runner.submit(sweep_shard, parameters=dict(spec=spec, shard=shard, model_sha256=model_sha256,
                                                               engines=engines)) for shard in shards]
        of = {id(future): shard for future, shard in zip(futures, shards)}
        paths = {}
        for k, future in enumerate(as_completed(futures)):  # shards done as they finish, whatever their order
            shard = of[id(future)]
            path = future.result()
            if not Path(path).is_file():  # a cached result whose file was removed: compute it again
                path = sweep_shard.with_options(refresh_cache=True)(spec, shard, model_sha256, engines)
            paths[shard.out] = path
            update_progress_artifact(progress, progress=100.0 * (k + 1) / len(futures))
            report("shards on Ray", k + 1, len(shards))
    paths = [paths[shard.out] for shard in shards]  # in the shards' order
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise RuntimeError(f"{len(missing)} shard files are not visible here (is the work folder shared with the "
                           f"Ray workers?): {missing[0]}")
    return paths


if __name__ == "__main__":
    print(study(StudySpec.of(limit=8)))
