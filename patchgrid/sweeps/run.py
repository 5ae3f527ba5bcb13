"""Running sweeps over many pairs: every kind's cells become requests, grouped by the layer they
start at (plan.Start) and batched across pairs into engine calls of at most `max_requests`,
patched from the activation store."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from ..cache import CacheError, CacheSpec
from ..metrics import Reading
from ..plan import LOGPROBS, Request, Start, latest_start
from .config import SweepConfig
from .kinds import SWEEP_KINDS, Cell, SweepContext, SweepKind, kind_sites

Progress = Callable[[int, int], None]  # (patched runs done, total)


def cache_spec(config: SweepConfig, n_layers: int, noise_std: float = 0.0) -> CacheSpec:
    """Every site and run the sweeps of `config` read from the activation cache (`noise_std`: the
    trace noise, which the noised runs cached for causal tracing are drawn with)."""
    ctx = SweepContext(config, n_layers, 0, noise_std)
    spec = CacheSpec(())
    for name in config.sweeps:
        spec = spec.merge(SWEEP_KINDS[name].needs(ctx))
    return spec


def check_family(config: SweepConfig, family) -> None:
    """Refuse, before anything runs, a sweep of a site the model's family does not have
    (sites.Family.missing: resid_mid in a parallel block, neurons in a mixture of experts)."""
    for name in config.sweeps:
        kinds = config.atp_kinds if name == "atp" else (name,)
        for site in (site for kind in kinds for site in kind_sites(SWEEP_KINDS[kind])):
            why = family.missing(site)
            if why:
                raise ValueError(f"sweep {name}: site {site}: {why}")


def count_runs(pairs, config: SweepConfig, n_layers: int, n_heads: int, d_mlp: int = 0, n_kv_heads: int = 0) -> int:
    ctx = SweepContext(config, n_layers, n_heads, d_mlp=d_mlp, n_kv_heads=n_kv_heads)
    return sum(SWEEP_KINDS[name].count(p, ctx) for p in pairs for name in config.sweeps)


def patched_runs(pairs, ctx: SweepContext) -> Iterator[tuple[int, SweepKind, Cell, Request]]:
    """Every patched run of the sweeps over `pairs`, pair by pair: (pair index, kind, cell, request).
    A request patches from the source named `{pair index}:{run}` and measures its KL divergence
    from the clean run's (`{pair index}:clean`); with `config.start_midstack` it starts at the latest layer
    its patches allow, from the stream of the run it equals below them."""
    for i, p in enumerate(pairs):
        for name in ctx.config.sweeps:
            kind = SWEEP_KINDS[name]
            for cell in kind.cells(p, ctx):
                req = kind.request(p, cell, ctx, f"{i}:{kind.source_run(cell)}")
                layer = latest_start(req.patches, ctx.n_layers) if ctx.config.start_midstack else 0
                start = Start(layer, f"{i}:{cell.stream}") if layer > 0 else None
                yield i, kind, cell, dataclasses.replace(req, start=start, reference=f"{i}:clean")


def trace_noise_std(store, pairs, scale: float) -> float:
    """scale x the std of the subject tokens' embeddings over `pairs`."""
    rows = [store.captures(p.pair_id, "clean", ["embed"])["embed"][p.subject_start:p.subject_end].float()
            for p in pairs]
    return scale * float(torch.cat(rows).std())


def run_sweeps(engine, pairs, store, config: SweepConfig, progress: Progress | None = None,
               noise_std: float | None = None, attributor=None) -> list[dict]:
    """Effect rows of every sweep of `config` over `pairs`.

    store: the pairs' cached activations and baselines (an ActivationCache or a MemoryStore).
    noise_std: the trace noise scale, when `pairs` is one shard of a larger data set whose
    subjects set it; by default it is computed over `pairs`.
    attributor: what the atp sweep takes its gradients on (patchgrid.attribution); by default one
    on the engine's model, in float32.
    """
    shape = engine.shape
    std = 0.0
    if "trace" in config.sweeps:
        if noise_std is not None:
            std = noise_std
        elif store.spec.noised():  # the noise the cached noised runs were drawn with
            std = store.spec.noise[0]
        else:
            std = trace_noise_std(store, pairs, config.trace_noise_scale)
    need = cache_spec(config, shape.n_layers, std)
    if not need.covered_by(store.spec):
        raise CacheError(f"the activation store holds {_described(store.spec)}; these sweeps need "
                         f"{_described(need)}: build it with cache_spec() of the same sweep settings")
    ctx = SweepContext(config, shape.n_layers, shape.n_heads, std, shape.d_mlp, shape.kv_heads)
    if "atp" in config.sweeps:
        from ..attribution import attributor_for

        estimates = SWEEP_KINDS["atp"].estimates(attributor or attributor_for(engine), pairs, ctx)
        ctx = dataclasses.replace(ctx, estimates=estimates)
    total = count_runs(pairs, config, shape.n_layers, shape.n_heads, shape.d_mlp, shape.kv_heads)
    readings: dict[tuple[int, str], list] = defaultdict(list)
    done = 0

    def run_all(runs, read, counted=True):
        """Engine calls over `runs` [(pair index, kind, cell, request)], each result handed to `read`.
        `counted`: runs that are cells of the grid (progress counts cells; a first pass is not one).
        Sorted by the layer they start at, so that an engine call holds few start layers (a call
        computes from one layer up; plan.Start); a shard's requests are small, its results are not."""
        nonlocal done
        runs = sorted(runs, key=lambda run: run[-1].start.layer if run[-1].start else 0)
        for k in range(0, len(runs), config.max_requests):
            buffer = runs[k:k + config.max_requests]
            sources = {}
            for *_, req in buffer:
                names = {p.source for p in req.patches} | {req.reference} | ({req.start.source} if req.start else set())
                for name in names - set(sources):
                    sources[name] = _source(store, ctx, pairs, name)
            for run, res in zip(buffer, engine.run([req for *_, req in buffer], sources)):
                read(run, res)
            if counted:
                done += len(buffer)
                if progress:
                    progress(done, total)

    if "paths" in config.sweeps:
        ctx = _first_pass(SWEEP_KINDS["paths"], pairs, ctx, run_all)

    runs, unchanged = [], []
    first_change = {}  # (pair index, kind) -> the pair's first position where the kind's runs differ
    for run in patched_runs(pairs, ctx):
        i, kind, cell, _ = run
        if (i, kind.name) not in first_change:
            first_change[i, kind.name] = kind.first_change(pairs[i])
        if config.start_midstack and kind.unchanged(cell, first_change[i, kind.name]):
            unchanged.append(run)
        elif (got := kind.known(cell, ctx, pairs[i])) is not None:  # read by a first pass
            readings[(i, kind.name)].append((cell, got))
            done += 1
        else:
            runs.append(run)
    run_all(runs, lambda run, res: readings[(run[0], run[1].name)].append((run[2], Reading.of(res))))
    if unchanged:
        _fill_unchanged(unchanged, readings, pairs, store)
        done += len(unchanged)
        if progress:
            progress(done, total)
    rows: list[dict] = []
    for i, p in enumerate(pairs):
        for name in config.sweeps:
            kind = SWEEP_KINDS[name]
            # cells arrive grouped by start layer: back in grid order, so that averages add up alike
            order = {cell: k for k, cell in enumerate(kind.cells(p, ctx))}
            got = sorted(readings[(i, name)], key=lambda cr, order=order: order[cr[0]])
            rows += kind.rows(p, got, store.baselines[p.pair_id], ctx)
    return rows


def _source(store, ctx: SweepContext, pairs, name: str) -> dict:
    """The activations a request names `{pair index}:{run}`: a cached run's (the clean run's with
    its log-probabilities, which KL divergences are measured from), or a first pass's (ctx.derived)."""
    i, _, run = name.partition(":")
    pair_id = pairs[int(i)].pair_id
    if ctx.derived and (pair_id, run) in ctx.derived:
        return ctx.derived[(pair_id, run)]
    caps = store.captures(pair_id, run)
    if run == "clean":
        caps[LOGPROBS] = store.logprobs(pair_id)
    return caps


def _first_pass(kind, pairs, ctx: SweepContext, run_all) -> SweepContext:
    """Path patching's first pass (sweeps.paths): per pair, sender and position, the sender patched
    and what follows it frozen; its readings and captures go into the context."""
    first, derived, runs = {p.pair_id: {} for p in pairs}, {}, []
    for i, p in enumerate(pairs):
        change = kind.first_change(p)
        for cell in kind.first_cells(p, ctx):
            if ctx.config.start_midstack and kind.unchanged(cell, change):
                continue  # every path of it equals the corrupt run: its cells are unchanged too
            req = kind.first_request(p, cell, ctx, f"{i}:clean", f"{i}:corrupt")
            layer = latest_start(req.patches, ctx.n_layers) if ctx.config.start_midstack else 0
            start = Start(layer, f"{i}:{cell.stream}") if layer > 0 else None
            runs.append((i, kind, cell, dataclasses.replace(req, start=start, reference=f"{i}:clean")))

    def read(run, res):
        i, _, cell, _ = run
        first[pairs[i].pair_id][cell] = Reading.of(res)
        derived[(pairs[i].pair_id, kind.first_run(cell))] = res.captures

    run_all(runs, read, counted=False)
    return dataclasses.replace(ctx, first_pass=first, derived=derived)


def _fill_unchanged(unchanged, readings, pairs, store) -> None:
    """Readings of the cells that change nothing: the runs they equal, already read."""
    from .kinds import baselines

    read = {(i, kind, cell): r for (i, kind), got in readings.items() for cell, r in got}
    for i, kind, cell, _ in unchanged:
        same = kind.same_run(cell)
        if same is None:
            clean, corrupt = baselines(store.baselines[pairs[i].pair_id])
            reading = corrupt if cell.direction == "denoise" else clean
        else:
            reading = read[(i, kind.name, same)]
        readings[(i, kind.name)].append((cell, reading))


def _described(spec: CacheSpec) -> str:
    runs = "; ".join(f"{run}: {len(keys)} sites" for run, keys in spec.captured().items())
    return runs + (f"; noise std {spec.noise[0]:g}, seed {spec.noise[1]}" if spec.noised() else "")
