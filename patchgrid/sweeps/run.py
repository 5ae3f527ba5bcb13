"""Running sweeps over many pairs: every kind's cells become requests, grouped by the layer they
start at (plan.Start) and batched across pairs into engine calls of at most `max_requests`,
patched from the activation store. The runner calls every kind's phases (sweeps.base) in the
run's order and names no kind."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

from ..cache import CacheError, CacheSpec
from ..methods.graph import circuit_keys
from ..metrics import METRICS
from ..plan import LOGPROBS, Request
from ..runtime.collector import cyclic_gc_paused
from .ablated import AblatedSources
from .base import Cell, SweepContext, SweepKind, SweepRun, as_runs, baselines
from .config import SweepConfig
from .registry import SWEEP_KINDS

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
        why = SWEEP_KINDS[name].family_refusal(family)
        if why:
            raise ValueError(f"sweep {name}: {why}")
        for site in SWEEP_KINDS[name].family_sites(config):
            why = family.missing(site)
            if why:
                raise ValueError(f"sweep {name}: site {site}: {why}")


def count_runs(pairs, config: SweepConfig, n_layers: int, n_heads: int, d_mlp: int = 0, n_kv_heads: int = 0) -> int:
    ctx = SweepContext(config, n_layers, n_heads, d_mlp=d_mlp, n_kv_heads=n_kv_heads)
    return sum(SWEEP_KINDS[name].count(p, ctx) for p in pairs for name in config.sweeps)


def patched_runs(pairs, ctx: SweepContext) -> Iterator[tuple[int, SweepKind, Cell, Request]]:
    """Every patched run of the sweeps over `pairs`, pair by pair: (pair index, kind, cell, request).
    A request patches from the source named `{pair index}:{run}`, reads the metrics its kind reads for
    the pair (SweepKind.metrics_read: KL from the clean run's `{pair index}:clean`); with
    `config.start_midstack` it starts at the latest layer its patches allow, from the stream of the
    run it equals below them."""
    for i, p in enumerate(pairs):
        for name in ctx.config.sweeps:
            kind = SWEEP_KINDS[name]
            run = as_runs(i, ctx, kind.metrics_read(p, ctx.config))
            for cell in kind.cells(p, ctx):
                yield i, kind, cell, run(kind.request(p, cell, ctx, kind.patch_source(i, cell, ctx)), cell)


class _Calls:
    """Engine calls over runs [(pair index, kind, cell, request)], the progress counted in cells."""

    def __init__(self, engine, pairs, store, max_requests: int, progress: Progress | None, total: int):
        self.engine, self.pairs, self.store, self.max_requests = engine, pairs, store, max_requests
        self.progress, self.total, self.done = progress, total, 0
        self.ablated = AblatedSources(engine.shape, pairs, store)

    def counted(self, n: int, report: bool = True) -> None:
        self.done += n
        if report and self.progress:
            self.progress(self.done, self.total)

    def run(self, runs, read, ctx: SweepContext, counted: bool = True, readings: bool = False) -> None:
        """Each result handed to `read`, or with `readings` its Reading (Engine.readings: what
        Reading.of reads of it). `counted`: runs that are cells of the grid (a phase's are not). In
        engine calls of at most max_requests runs (a shard's requests are small, its results are
        not), cut by start_layer_calls."""
        call = self.engine.readings if readings else self.engine.run
        for buffer in start_layer_calls(runs, self.max_requests):
            sources, wanted = {}, defaultdict(set)  # wanted: the site keys read of each source
            for *_, req in buffer:
                for p in req.patches:
                    wanted[p.source].add(p.key)
                if req.circuit is not None:
                    wanted[req.circuit.source].update(circuit_keys(self.engine.shape.n_layers))
                for name in (req.reference, req.start.source if req.start is not None else None):
                    if name is not None and name not in wanted:  # a source named, whatever keys it is read for
                        wanted[name] = set()
            for name, keys in wanted.items():
                sources[name] = self.ablated.get(name, keys) or _source(self.store, ctx, self.pairs, name)
            for run, res in zip(buffer, call([req for *_, req in buffer], sources)):
                read(run, res)
            if counted:
                self.counted(len(buffer))

    def uncounted(self, runs, read, ctx: SweepContext) -> None:
        self.run(runs, read, ctx, counted=False)


def start_layer_calls(runs: list, size: int) -> list[list]:
    """Runs [(..., request)] cut into engine calls of at most `size`, sorted by the layer they start
    at: a call computes from one layer up (plan.Start), so the engine splits a call by start layer
    (VllmEngine: merge_starts); calls are cut where a start layer's runs end, and a start layer's
    runs are split only where they alone are more than `size`, so that no start layer is cut in
    two calls more than it must be."""
    by_layer: dict[int, list] = defaultdict(list)
    for run in runs:
        by_layer[run[-1].start.layer if run[-1].start else 0].append(run)
    calls: list[list] = []
    current: list = []
    for layer in sorted(by_layer):
        group = by_layer[layer]
        if current and len(current) + len(group) > size:
            calls.append(current)
            current = []
        while len(group) > size:
            calls.append(group[:size])
            group = group[size:]
        current += group
    if current:
        calls.append(current)
    return calls


def run_sweeps(engine, pairs, store, config: SweepConfig, progress: Progress | None = None,
               noise_std: float | None = None, attributor: object | dict | None = None) -> list[dict]:
    """Effect rows of every sweep of `config` over `pairs`.

    store: the pairs' cached activations and baselines (an ActivationCache or a MemoryStore).
    noise_std: the trace noise scale, when `pairs` is one shard of a larger data set whose
    subjects set it; by default it is computed over `pairs`.
    attributor: what the atp sweep takes its gradients on (patchgrid.methods.attribution): an Attributor, or
    the options of one on the engine's model (attributor_for's `device` and `dtype`: a ShardSpec's
    `attribution`, StudySpec.attribution_options()); by default float32, on a GPU when there is one.
    """
    shape = engine.shape
    kinds = [SWEEP_KINDS[name] for name in config.sweeps]
    total = count_runs(pairs, config, shape.n_layers, shape.n_heads, shape.d_mlp, shape.kv_heads)
    calls = _Calls(engine, pairs, store, config.max_requests, progress, total)
    calls.counted(0)  # the bar shows from the start: a kind's phases (atp's gradients) come first
    phase = SweepRun(engine, pairs, store, noise_std, attributor, calls.uncounted)
    ctx = SweepContext(config, shape.n_layers, shape.n_heads, 0.0, shape.d_mlp, shape.kv_heads)
    for kind in kinds:
        ctx = kind.settle(ctx, phase)
    need = cache_spec(config, shape.n_layers, ctx.noise_std)
    if not need.covered_by(store.spec):
        raise CacheError(f"the activation store holds {_described(store.spec)}; these sweeps need "
                         f"{_described(need)}: build it with cache_spec() of the same sweep settings")
    for kind in kinds:
        ctx = kind.prepare(ctx, phase)
    readings: dict[tuple[int, str], list] = defaultdict(list)
    with cyclic_gc_paused():  # the grid's requests, results, readings and rows make no reference cycles
        runs, unchanged, order = _sorted_cells(pairs, ctx, readings)
        calls.counted(sum(len(got) for got in readings.values()), report=False)  # read by a phase
        calls.run(runs, lambda run, reading: readings[(run[0], run[1].name)].append((run[2], reading)), ctx,
                  readings=True)
        if unchanged:
            _fill_unchanged(unchanged, readings, pairs, store)
            calls.counted(len(unchanged))
        return _rows(pairs, ctx, kinds, readings, store, order)


def _sorted_cells(pairs, ctx: SweepContext, readings) -> tuple[list, list, dict]:
    """The grid's runs: those to run, and those that change nothing (config.start_midstack); the
    readings a phase already has go into `readings`; and each cell's place in its pair's grid of
    its kind, by the cell object's id (the cells live as long as the runs: _rows reads it)."""
    runs, unchanged, order = [], [], {}
    first_change = {}  # (pair index, kind) -> the pair's first position where the kind's runs differ
    for run in patched_runs(pairs, ctx):
        i, kind, cell, _ = run
        order[id(cell)] = len(order)  # patched_runs yields each pair's grid of each kind in order
        if (i, kind.name) not in first_change:
            first_change[i, kind.name] = kind.first_change(pairs[i])
        # a patch before the first change writes what is there, unless it writes an ablation's value
        ablated = kind.ablatable and ctx.config.ablation != "patching"
        if ctx.config.start_midstack and not ablated and kind.unchanged(cell, first_change[i, kind.name]):
            unchanged.append(run)
        elif (got := kind.reading_without_run(cell, ctx, pairs[i])) is not None:
            readings[(i, kind.name)].append((cell, got))
        else:
            runs.append(run)
    return runs, unchanged, order


def _rows(pairs, ctx: SweepContext, kinds, readings, store, order: dict) -> list[dict]:
    rows: list[dict] = []
    for i, p in enumerate(pairs):
        for kind in kinds:
            # cells arrive grouped by start layer: back in grid order, so that averages add up alike
            got = sorted(readings[(i, kind.name)], key=lambda cr: order[id(cr[0])])
            if set(ctx.config.metrics) != set(METRICS):  # unchanged cells and phases read every metric
                read = kind.metrics_read(p, ctx.config)
                got = [(cell, None if r is None else r.only(read)) for cell, r in got]
            kind_rows = kind.rows(p, got, store.baselines[p.pair_id], ctx)
            if kind.ablatable and ctx.config.ablation != "patching":
                for row in kind_rows:
                    row["ablation"] = ctx.config.ablation
            rows += kind_rows
    return rows


def _source(store, ctx: SweepContext, pairs, name: str) -> dict:
    """The activations a request names `{pair index}:{run}`: a cached run's (the clean run's with
    its log-probabilities, which KL divergences are measured from), or a phase's (ctx.derived)."""
    i, _, run = name.partition(":")
    pair_id = pairs[int(i)].pair_id
    if ctx.derived and (pair_id, run) in ctx.derived:
        return ctx.derived[(pair_id, run)]
    caps = store.captures(pair_id, run)
    if run == "clean":
        caps[LOGPROBS] = store.logprobs(pair_id)
    return caps


def _fill_unchanged(unchanged, readings, pairs, store) -> None:
    """Readings of the cells that change nothing: the runs they equal, already read."""
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
