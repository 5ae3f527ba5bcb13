from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from prefect import get_run_logger, task

from patchgrid.backends.engine import Engines, using_engine
from patchgrid.pairs import Pair
from patchgrid.pipeline.spec import StudySpec

from .keys import keyed_by


@lru_cache(maxsize=16)
def _n_layers(model: str) -> int:
    """The model's layers, read once per process (the key function and the task body both ask)."""
    from transformers import AutoConfig

    from patchgrid.model.models import prepare
    from patchgrid.model.sites import shape_of

    return shape_of(AutoConfig.from_pretrained(prepare(model))).n_layers


def cache_inputs(spec: StudySpec, sweeps: tuple[str, ...], noise_std: float = 0.0) -> dict:
    """What an activation cache holds: the engine that captures it and the cache specification the
    sweeps `sweeps` need (every site and run they read, the noise of the noised runs)."""
    from dataclasses import replace

    from patchgrid.sweeps import cache_spec

    need = cache_spec(replace(spec.sweep, sweeps=tuple(sweeps)), _n_layers(spec.model), noise_std)
    return dict(model=spec.model, backend=spec.backend, cache=need)


def found_or_built(pairs, need, root: str, *, engine) -> tuple[str, bool, float]:
    """The cache folder covering `need` for `pairs` (found, or built on `engine`), whether it was
    built, and its size per pair: plain values, which cross back from an engine actor."""
    from patchgrid.cache import load_or_build
    from patchgrid.runtime.progress import stage

    cache, built = load_or_build(engine, pairs, need, Path(root), progress=stage("activation cache (pairs captured)"))
    return str(cache.folder), built, cache.bytes_per_pair


@task(cache_key_fn=keyed_by(cache_inputs), persist_result=True, retries=2, retry_delay_seconds=1)
def cache_activations(spec: StudySpec, pairs: list[Pair], cache_root: str, model_sha256: str,
                      engines: Engines, sweeps: tuple[str, ...], noise_std: float = 0.0) -> str:
    """Capture each pair's clean (and corrupt, and noised) runs once, the sites `sweeps` read and the
    streams their patched runs start from, where the engines run; return the cache folder."""
    v = cache_inputs(spec, sweeps, noise_std)
    folder, built, per_pair = engines.run(using_engine(found_or_built, list(pairs), v["cache"], cache_root))
    get_run_logger().info("activation cache %s: %s, %.1f kB per pair", folder, "built" if built else "found",
                          per_pair / 1e3)
    return folder
