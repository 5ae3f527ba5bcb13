from __future__ import annotations

import os
from pathlib import Path

from prefect import get_run_logger, task

from .engines import drop_engine, get_engine
from .keys import inputs_key

# Callables (done, total) told of progress inside a shard; the CLI's progress bar registers one.
PROGRESS_HOOKS: list = []


def compute_shard(engine, pairs_table: str, cache_folder: str, pair_ids: list[str], out: str, sweeps: list[str],
                  trace_samples: int, seed: int, noise_std: float, max_requests: int, progress=None) -> int:
    """Every sweep over one shard of pairs, written as one Parquet file (by rename); returns its rows."""
    from patchgrid.cache import ActivationCache
    from patchgrid.effects import write_effects
    from patchgrid.pairs import accepted_pairs, read_pairs
    from patchgrid.sweeps import SweepConfig, run_sweeps

    wanted = set(pair_ids)
    pairs = [p for p in accepted_pairs(read_pairs(pairs_table)) if p.pair_id in wanted]
    config = SweepConfig(sweeps=tuple(sweeps), trace_samples=trace_samples, seed=seed, max_requests=max_requests)
    rows = run_sweeps(engine, pairs, ActivationCache(Path(cache_folder)), config, progress=progress,
                      noise_std=noise_std)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_effects(rows, out)
    return len(rows)


@task(cache_key_fn=inputs_key, persist_result=True, retries=2, retry_delay_seconds=1)
def sweep_shard(model: str, pairs_table: str, cache_folder: str, pair_ids: list[str], out: str, sweeps: list[str],
                trace_samples: int, seed: int, noise_std: float, max_requests: int = 2048, backend: str = "vllm",
                model_sha256: str = "") -> str:
    """Run every sweep over one shard of pairs in this process's engine; return the Parquet path."""
    logger = get_run_logger()
    if Path(out).is_file():  # written whole (rename) by an earlier attempt of this same shard
        logger.info("shard %s already done", out)
        return out
    engine = get_engine(model, backend)

    def progress(done, total):
        for hook in PROGRESS_HOOKS:
            hook(done, total)

    try:
        n = compute_shard(engine, pairs_table, cache_folder, pair_ids, out, sweeps, trace_samples, seed, noise_std,
                          max_requests, progress)
    except Exception:
        drop_engine(model, backend)  # a retry starts a fresh engine
        raise
    logger.info("shard of %d pairs: %d effect rows -> %s (pid %d)", len(pair_ids), n, out, os.getpid())
    return out
