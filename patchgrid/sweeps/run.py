"""Running sweeps over many pairs: every kind's cells become requests, batched across pairs into
engine calls of at most `max_requests`, patched from the activation store."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from ..cache import CacheSpec
from ..metrics import Reading
from ..plan import Request
from .config import SweepConfig
from .kinds import SWEEP_KINDS, Cell, SweepContext, SweepKind

Progress = Callable[[int, int], None]  # (patched runs done, total)


def cache_spec(config: SweepConfig, n_layers: int) -> CacheSpec:
    """Every site and run the sweeps of `config` read from the activation cache."""
    keys: list[str] = []
    runs = ["clean"]
    for name in config.sweeps:
        need = SWEEP_KINDS[name].needs(config, n_layers)
        keys += need.keys
        runs += need.runs
    return CacheSpec(tuple(dict.fromkeys(keys)), tuple(dict.fromkeys(runs)))


def count_runs(pairs, config: SweepConfig, n_layers: int, n_heads: int) -> int:
    ctx = SweepContext(config, n_layers, n_heads)
    return sum(len(SWEEP_KINDS[name].cells(p, ctx)) for p in pairs for name in config.sweeps)


def patched_runs(pairs, ctx: SweepContext) -> Iterator[tuple[int, SweepKind, Cell, Request]]:
    """Every patched run of the sweeps over `pairs`, pair by pair: (pair index, kind, cell, request).
    A request patches from the source named `{pair index}:{run}`."""
    for i, p in enumerate(pairs):
        for name in ctx.config.sweeps:
            kind = SWEEP_KINDS[name]
            for cell in kind.cells(p, ctx):
                yield i, kind, cell, kind.request(p, cell, ctx, f"{i}:{cell.source}")


def trace_noise_std(store, pairs, scale: float) -> float:
    """scale x the std of the subject tokens' embeddings over `pairs`."""
    rows = [store.captures(p.pair_id, "clean", ["embed"])["embed"][p.subject_start:p.subject_end].float()
            for p in pairs]
    return scale * float(torch.cat(rows).std())


def run_sweeps(engine, pairs, store, config: SweepConfig, progress: Progress | None = None,
               noise_std: float | None = None) -> list[dict]:
    """Effect rows of every sweep of `config` over `pairs`.

    store: the pairs' cached activations and baselines (an ActivationCache or a MemoryStore).
    noise_std: the trace noise scale, when `pairs` is one shard of a larger data set whose
    subjects set it; by default it is computed over `pairs`.
    """
    shape = engine.shape
    std = 0.0
    if "trace" in config.sweeps:
        std = noise_std if noise_std is not None else trace_noise_std(store, pairs, config.trace_noise_scale)
    ctx = SweepContext(config, shape.n_layers, shape.n_heads, std)
    total = count_runs(pairs, config, shape.n_layers, shape.n_heads)
    readings: dict[tuple[int, str], list] = defaultdict(list)
    done = 0
    buffer: list[tuple] = []  # (pair index, kind, cell, request)

    def flush():
        nonlocal done
        sources = {}
        for i, _, cell, _ in buffer:
            name = f"{i}:{cell.source}"
            if name not in sources:
                sources[name] = store.captures(pairs[i].pair_id, cell.source)
        results = engine.run([req for *_, req in buffer], sources)
        for (i, kind, cell, _), res in zip(buffer, results):
            readings[(i, kind.name)].append((cell, Reading.of(res)))
        done += len(buffer)
        buffer.clear()
        if progress:
            progress(done, total)

    for run in patched_runs(pairs, ctx):
        buffer.append(run)
        if len(buffer) >= config.max_requests:
            flush()
    if buffer:
        flush()
    rows: list[dict] = []
    for i, p in enumerate(pairs):
        for name in config.sweeps:
            rows += SWEEP_KINDS[name].rows(p, readings[(i, name)], store.baselines[p.pair_id], ctx)
    return rows
