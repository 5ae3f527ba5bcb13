"""A study's sweeps in shards: each shard's pairs swept in one engine, written as Parquet files."""
from __future__ import annotations

from pathlib import Path

from ..cache import ActivationCache
from ..rows.effects import write_effects
from ..rows.shapes import BASELINE
from ..rows.staging import write_parquet
from ..runtime.progress import Progress
from ..sweeps import SweepConfig, run_sweeps
from .fingerprint import fingerprint
from .spec import ShardSpec


def split(pairs, size: int, cache_folder: str, sweep: SweepConfig, noise_std: float, out_dir: Path, *,
          first: int = 0, name: str = "shard", writes_baselines: bool = True,
          attribution: dict | None = None) -> list[ShardSpec]:
    """Shards of `size` pairs, numbered from `first`, written as out_dir/<name>-<index>-<inputs>.parquet:
    <inputs> is a fingerprint of what the shard computes (its pairs, cache and sweep settings), so
    that a rerun whose shards hold other pairs (another shard size) never takes an earlier file."""
    shards = []
    for k, start in enumerate(range(0, len(pairs), size)):
        chunk = tuple(pairs[start:start + size])
        inputs = fingerprint(list(chunk), cache_folder, sweep, noise_std, writes_baselines,
                             *([attribution] if attribution else []))[:10]
        shards.append(ShardSpec(first + k, chunk, cache_folder, sweep, noise_std,
                                str(out_dir / f"{name}-{first + k:05d}-{inputs}.parquet"), writes_baselines,
                                dict(attribution or {})))
    return shards


def compute_shard(engine, shard: ShardSpec, progress: Progress | None = None) -> int:
    """Every sweep over the shard's pairs; writes their baselines, then their effects (whose file,
    renamed into place last, marks the shard done). Returns the number of effect rows."""
    cache = ActivationCache(Path(shard.cache_folder))
    pairs = list(shard.pairs)
    rows = run_sweeps(engine, pairs, cache, shard.sweep, progress=progress, noise_std=shard.noise_std,
                      attributor=shard.attribution or None)
    Path(shard.out).parent.mkdir(parents=True, exist_ok=True)
    if shard.writes_baselines:
        write_parquet(BASELINE.table([cache.baselines[p.pair_id] for p in pairs]), shard.baselines_out)
    write_effects(rows, shard.out)
    return len(rows)
