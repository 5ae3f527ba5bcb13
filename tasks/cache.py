"""The cache step as a Prefect task: cached by the cache specification it builds, retried, logged."""
from __future__ import annotations

from prefect import get_run_logger, task

from patchgrid.backends.engine import Engines
from patchgrid.pairs import Pair
from patchgrid.pipeline.spec import StudySpec
from patchgrid.pipeline.steps import activation_cache, cache_inputs

from .keys import keyed_by


@task(cache_key_fn=keyed_by(cache_inputs), persist_result=True, retries=2, retry_delay_seconds=1)
def cache_activations(spec: StudySpec, pairs: list[Pair], cache_root: str, model_sha256: str,
                      engines: Engines, sweeps: tuple[str, ...], noise_std: float = 0.0) -> str:
    """Capture each pair's clean (and corrupt, and noised) runs once, the sites `sweeps` read and the
    streams their patched runs start from, where the engines run (patchgrid.pipeline.steps.activation_cache);
    return the cache folder."""
    found = activation_cache(engines, pairs, cache_inputs(spec, sweeps, noise_std)["cache"], cache_root)
    get_run_logger().info("activation cache %s: %s, %.1f kB per pair", found.folder,
                          "built" if found.built else "found", found.bytes_per_pair / 1e3)
    return found.folder
