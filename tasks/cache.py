from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from patchgrid.engine import EnginePool
from patchgrid.pairs import Pair
from patchgrid.spec import StudySpec

from .keys import keyed_on


@task(cache_key_fn=keyed_on("model", "backend", "sweeps", "trace_samples", "seed", "skip"), persist_result=True,
      retries=2, retry_delay_seconds=1)
def cache_activations(spec: StudySpec, pairs: list[Pair], cache_root: str, model_sha256: str,
                      engines: EnginePool, sweeps: tuple[str, ...], noise_std: float = 0.0) -> str:
    """Capture each pair's clean (and corrupt, and noised) runs once, the sites `sweeps` read and the
    streams their patched runs start from; return the cache folder."""
    from dataclasses import replace

    from patchgrid.cache import load_or_build
    from patchgrid.sweeps import cache_spec

    logger = get_run_logger()
    engine = engines.get(spec.model, spec.backend)
    try:
        cache, built = load_or_build(engine, pairs, cache_spec(replace(spec.sweep_config(), sweeps=tuple(sweeps)), engine.shape.n_layers,
                                                                noise_std),
                                     Path(cache_root), log=logger.info)
    except Exception:
        engines.drop(spec.model, spec.backend)  # a retry starts a fresh engine
        raise
    logger.info("activation cache %s: %s, %.1f kB per pair", cache.folder, "built" if built else "found",
                cache.bytes_per_pair / 1e3)
    return str(cache.folder)
