"""Every setting, changed alone (tests/support/reruns.py): the cache keys of the study's steps, as its
tasks compute them from the arguments the flow hands them, change for the steps whose output depends
on the setting and stay for the others; and the run id changes exactly when the setting identifies the
run. The arguments are made by the pipeline's own steps (the pairs table written and the cache built,
for real, on the hf engine; no sweep runs), so a key is the one a rerun would look up.
tests/flow/flows/test_settings_rerun.py shows on a few real reruns that Prefect finds its results by
these keys."""
from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from patchgrid.backends.engine import LocalEngines
from patchgrid.pipeline import steps
from patchgrid.pipeline.fingerprint import fingerprint
from patchgrid.pipeline.memory import study_engine_options
from patchgrid.pipeline.spec import StudySpec
from patchgrid.settings import settings_fields
from patchgrid.sweeps import SweepConfig, noised
from patchgrid.tasks.cache import cache_activations
from patchgrid.tasks.pairs import align_pairs
from patchgrid.tasks.sweeps import measure_trace_noise, sweep_shard
from tests.support.reruns import (
    BASE,
    CASES,
    CHANGES,
    NEEDS_A_KNOWING_MODEL,
    NEEDS_RAY,
    STEPS,
    expected,
    identity_params,
    rerun_spec,
)


def test_every_setting_is_walked():
    names = {f.name for cls in (StudySpec, SweepConfig) for f in settings_fields(cls)}
    assert set(CHANGES) | NEEDS_RAY | NEEDS_A_KNOWING_MODEL == names
    assert not set(CHANGES) & (NEEDS_RAY | NEEDS_A_KNOWING_MODEL)


def key_of(task, *args) -> str:
    """The cache key `task` computes for a call with `args` (positional, as the flow calls it)."""
    parameters = inspect.signature(task.fn).bind(*args).arguments
    return task.cache_key_fn(SimpleNamespace(task=SimpleNamespace(name=task.name)), dict(parameters))


TABLES: dict[str, str] = {}  # the pairs tables written, by the fingerprint of their pairing inputs


def step_keys(spec: StudySpec, engines) -> tuple[str, dict[str, set[str]]]:
    """(the run id, each step's cache keys) of a study of `spec`: the arguments made as the flow makes
    them (flows/study.py), the pairs table and the cache for real."""
    from patchgrid.pairs import read_pairs

    model_sha = steps.model_sha256(spec.model)
    spec = spec.with_run_id(spec.run_id or spec.default_run_id(model_sha))
    work = Path(spec.workdir).resolve()
    run_dir = work / "runs" / spec.run_id
    table = str(run_dir / "pairs.parquet")
    keys = {step: set() for step in STEPS}
    keys["align_pairs"].add(key_of(align_pairs, spec, model_sha, table, engines))
    std = 0.0
    if noised(spec.sweeps):
        if spec.trace_noise is None:
            keys["measure_trace_noise"].add(key_of(measure_trace_noise, spec, model_sha))
            v = steps.noise_inputs(spec)
            std = steps.trace_noise(v["model"], steps.data_set_subjects(v["source"], v["fmt"]), v["scale"]).std
        else:
            std = spec.trace_noise
    pairing = steps.pairing_inputs(spec)
    made = TABLES.get(fingerprint(pairing))
    if made is None:  # a pairs table is a function of its pairing inputs: written once per inputs here
        steps.write_pairs_table(pairing, table, engines)
        TABLES[fingerprint(pairing)] = table
    elif made != table:
        Path(table).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(made, table)
    shards = []
    for group in steps.groups(read_pairs(table), spec.sweep, spec.limit):
        noise_std = group.noise_std(std)
        args = (spec, group.members, str(work / "cache"), model_sha, engines, group.names, noise_std)
        keys["cache_activations"].add(key_of(cache_activations, *args))
        need = steps.cache_inputs(spec, group.names, noise_std)["cache"]
        folder = steps.activation_cache(engines, group.members, need, str(work / "cache")).folder
        shards += steps.shards_of(group, folder, noise_std, run_dir / "effects", spec.shard_size, first=len(shards),
                                  attribution=spec.attribution_options())
    keys["sweep_shard"] = {key_of(sweep_shard, spec, shard, model_sha, engines) for shard in shards}
    return spec.run_id, keys


def study_engines(spec: StudySpec, pool) -> LocalEngines:
    """The study's engines as the flow makes them, from the session's pool."""
    return LocalEngines(spec.model, spec.backend, study_engine_options(spec), pool=pool)


@pytest.fixture(scope="module")
def base_keys(tmp_path_factory, engines):
    tmp = tmp_path_factory.mktemp("keys")
    spec = StudySpec.of(**BASE, warehouse=str(tmp / "w.duckdb"), workdir=str(tmp / "work"))
    return spec, *step_keys(spec, study_engines(spec, engines))


@pytest.mark.parametrize("case", CASES)
def test_a_setting_changes_the_keys_of_the_steps_that_depend_on_it(base_keys, engines, case, tmp_path):
    spec, base_id, base = base_keys
    recomputed, cached = expected(case)
    changed = rerun_spec(spec, case, tmp_path)
    run_id, keys = step_keys(changed, study_engines(changed, engines))
    for step in recomputed:
        assert keys[step] - base[step], f"{case}: {step} would be found cached"
    for step in cached:
        assert keys[step] <= base[step], f"{case}: {step} would be computed again"
    # a setting that enters the run id gives another run; one only noted (the engines' sizes) does not
    names = case.split("+")
    identifies = any(n in identity_params(spec) or n in identity_params(changed) for n in names)
    assert (run_id != base_id) == (identifies or case == "run_id"), case
