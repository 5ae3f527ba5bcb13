from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from .engines import drop_engine, get_engine
from .keys import inputs_key


@task(cache_key_fn=inputs_key, persist_result=True, retries=2, retry_delay_seconds=1)
def cache_activations(model: str, pairs_table: str, cache_root: str, sweeps: list[str], limit: int | None,
                      trace_samples: int, backend: str = "vllm", model_sha256: str = "") -> str:
    """Capture each accepted pair's clean (and corrupt) activations once; return the cache folder."""
    from patchgrid.cache import load_or_build
    from patchgrid.pairs import accepted_pairs, read_pairs
    from patchgrid.sweeps import SweepConfig, cache_spec

    logger = get_run_logger()
    pairs = accepted_pairs(read_pairs(pairs_table), limit)
    config = SweepConfig(sweeps=tuple(sweeps), trace_samples=trace_samples)
    engine = get_engine(model, backend)
    try:
        cache, built = load_or_build(engine, pairs, cache_spec(config, engine.shape.n_layers), Path(cache_root),
                                     log=logger.info)
    except Exception:
        drop_engine(model, backend)  # a retry starts a fresh engine
        raise
    logger.info("activation cache %s: %s, %.1f kB per pair", cache.folder, "built" if built else "found",
                cache.bytes_per_pair / 1e3)
    return str(cache.folder)
