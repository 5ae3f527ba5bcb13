"""Sweep kinds: each knows its grid of patched runs (cells), the request for each cell, what the
cache must hold for it, and how its runs become effect rows.

    resid     layer x position; denoise (clean into corrupt) and noise (corrupt into clean)
    resid_pre layer x position, denoise: the stream entering each layer (layer 0: the embedding)
    resid_mid layer x position, denoise: the stream between each layer's attention and MLP
    attn_out  layer x position, denoise
    mlp_out   layer x position, denoise
    embed     position, denoise (the token embedding: a patch is a token swap)
    heads     layer x head: every position at once, and at chosen positions (by role)
    neurons   layer x MLP neuron, at the same positions as heads (exhaustive only on small models;
              the atp sweep screens them)
    qkv       layer x head x position for each of q, k and v (k and v by key/value head), at the
              same positions as heads
    paths     path patching (patchgrid.sweeps.paths): senders x receivers (the logits, or later
              heads' q, k, v inputs) at the positions heads are patched at
    trace     causal tracing: Gaussian noise on the subject's embeddings, restore the clean hidden
              state at one (layer, position), or the clean MLP / attention output over a window of
              layers at one position; metric: the clean answer's probability, averaged over samples
    atp       attribution patching: every cell of the screened kinds (denoise) estimated from
              gradients (patchgrid.attribution), then per pair and kind the top K cells by the
              estimate and R sampled from the rest patched exactly; one row per screened cell

To add a sweep kind: a `SweepKind` subclass here and its entry in `SWEEP_KINDS`.
"""
from __future__ import annotations

import dataclasses
import random
import zlib
from collections import defaultdict
from dataclasses import dataclass

from ..cache import NOISED, CacheSpec, layer_keys, stream_keys
from ..effects import cell_columns, effect_row, reading_from
from ..metrics import Reading
from ..plan import Noise, Patch, Request, trace_seed
from ..sites import SITES


@dataclass(frozen=True)
class Cell:
    """One patched run of a sweep, by its coordinates (what an effect row is keyed by)."""

    sweep: str
    site: str | None  # None: the unpatched noised run of a trace sample
    direction: str = "denoise"
    layer: int | None = None  # for windowed trace cells, the window's centre
    position: int | None = None  # None: every position at once
    head: int | None = None
    window: int | None = None
    sample: int | None = None  # trace: the noise sample
    neuron: int | None = None
    receiver: str | None = None  # paths: `logits` or a later head's input (sites.unit_name); site etc.: the sender

    @property
    def source(self) -> str:
        """The cached run whose activations the patch writes."""
        return "corrupt" if self.direction == "noise" else "clean"

    @property
    def stream(self) -> str:
        """The cached run this patched run equals below its patches (where it may start): the run
        the patch goes into, or for causal tracing the noised run of its sample."""
        if self.sample is not None:
            return f"{NOISED}{self.sample}"
        return "clean" if self.direction == "noise" else "corrupt"


@dataclass(frozen=True)
class SweepContext:
    """What a sweep's grid depends on besides the pair."""

    config: object  # SweepConfig
    n_layers: int
    n_heads: int
    noise_std: float = 0.0  # trace
    d_mlp: int = 0  # neurons per layer
    n_kv_heads: int = 0  # key/value heads per layer; 0: as many as heads
    # atp: per pair id, {cell: (estimate, GradDrop score or None, `top`/`random`/None)} in grid
    # order (AtpSweep.estimates)
    estimates: dict | None = None
    # paths: per pair id, {first-pass cell: Reading}, and the first passes' captures by
    # (pair id, run name): the sources pass 2 patches from (sweeps.paths)
    first_pass: dict | None = None
    derived: dict | None = None


class SweepKind:
    name: str
    metric = "logit_diff"  # the headline metric (an effect row's `effect` and `recovery`)
    # How the report draws the kind's rows (patchgrid.report): layer_by_role (a heatmap of layer x
    # position role), layer_by_head, trace_buckets, paths, atp, or none (not drawn: a cell per neuron)
    drawing = "layer_by_role"
    # The SweepConfig fields the kind reads beyond the common ones (settings_of): what a run
    # records only when one of its kinds reads it
    settings: tuple[str, ...] = ()

    def headline(self, pair) -> str:
        """The headline metric for `pair`: a pair whose answers are scored whole has no logit
        difference, and takes the log-probability difference instead."""
        if self.metric == "logit_diff" and (len(pair.clean_answer_ids) > 1 or len(pair.corrupt_answer_ids) > 1):
            return "logprob_diff"
        return self.metric

    def needs(self, ctx: SweepContext) -> CacheSpec:
        """What the cache must hold: the sites the patches read, and with `config.start_midstack` the streams
        of the runs the patched runs start from."""
        raise NotImplementedError

    def cells(self, pair, ctx: SweepContext) -> list[Cell]:
        raise NotImplementedError

    def count(self, pair, ctx: SweepContext) -> int:
        """How many patched runs the kind makes for `pair`."""
        return len(self.cells(pair, ctx))

    def request(self, pair, cell: Cell, ctx: SweepContext, source: str) -> Request:
        """The engine request for `cell`; `source` names the cached run it patches from."""
        raise NotImplementedError

    def source_run(self, cell: Cell) -> str:
        """The run whose activations `cell`'s patch writes (a cached run, or one ctx.derived holds)."""
        return cell.source

    def known(self, cell: Cell, ctx: SweepContext, pair) -> Reading | None:
        """A reading `cell` already has without a run of its own (None: run it)."""
        return None

    def first_change(self, pair) -> int:
        """The first position where the run a patch reads from and the run it goes into differ
        (clean and corrupt tokens here)."""
        return next((k for k, (a, b) in enumerate(zip(pair.clean_ids, pair.corrupt_ids)) if a != b),
                    len(pair.clean_ids))

    @staticmethod
    def unchanged(cell: Cell, first_change: int) -> bool:
        """Whether `cell` patches only positions before `first_change` (the pair's): attention is
        causal, so there both runs hold the same activations, the patch writes what is already
        there, and the run equals the unpatched run it goes into (`same_run`) without being run."""
        return cell.site is not None and cell.position is not None and cell.position < first_change

    def same_run(self, cell: Cell) -> Cell | None:
        """The cell whose reading an unchanged cell has; None: the baseline of the run it goes into
        (corrupt when denoising, clean when noising)."""
        return None

    def rows(self, pair, readings: list[tuple[Cell, Reading]], baseline: dict, ctx: SweepContext) -> list[dict]:
        """Effect rows from every cell's reading (one row per cell, unless the kind averages)."""
        clean, corrupt = baselines(baseline)
        metric = self.headline(pair)
        return [effect_row(pair, cell, r, clean, corrupt, metric) for cell, r in readings]


def baselines(row: dict) -> tuple[Reading, Reading]:
    """A baseline row (rows.BASELINE) as the clean and corrupt runs' readings."""
    return reading_from(row, "clean"), reading_from(row, "corrupt")


def _positions(pair, config) -> list[int]:
    return list(range(len(pair.clean_ids))) if config.positions is None else list(config.positions)


def unit_positions(pair, config) -> list[int | None]:
    """Where heads, neurons and paths are patched: the given positions one by one; or every position
    one by one (head_positions `every`); or every position at once (None) and the positions of the
    head_position_roles."""
    if config.positions is not None:
        return list(config.positions)
    if config.head_positions == "every":
        return list(range(len(pair.corrupt_ids)))
    chosen = [None] + [pair.roles.index(role) for role in config.head_position_roles if role in pair.roles]
    return list(dict.fromkeys(chosen))


def _tokens(pair, direction: str):
    """The prompt a patch goes into: corrupt when denoising, clean when noising."""
    return pair.corrupt_ids if direction == "denoise" else pair.clean_ids


def _scored(pair) -> dict:
    """What every run of a pair reads: both answers' first tokens at the last prompt position, and
    both answers scored whole after it."""
    return dict(answers=pair.answers, continuations=pair.continuations)


class PositionSweep(SweepKind):
    """One site patched at one (layer, position) per run."""

    def __init__(self, site: str, *, layered: bool = True, both_directions: bool = False):
        self.name = self.site = site
        self.layered, self.both_directions = layered, both_directions

    def _directions(self, config) -> tuple[str, ...]:
        return config.resid_directions if self.both_directions else ("denoise",)

    def needs(self, ctx):
        config = ctx.config
        keys = layer_keys(self.site, ctx.n_layers) if self.layered else ("embed",)
        runs = ("clean", "corrupt") if "noise" in self._directions(config) else ("clean",)
        streams = ()
        if config.start_midstack and self.layered:  # the embedding patch starts at the embedding
            streams = tuple((Cell(self.name, self.site, d).stream, stream_keys(ctx.n_layers))
                            for d in self._directions(config))
        return CacheSpec(keys, runs, streams)

    def cells(self, pair, ctx):
        layers = range(ctx.n_layers) if self.layered else [None]
        positions = _positions(pair, ctx.config)
        return [Cell(self.name, self.site, direction, layer, pos)
                for direction in self._directions(ctx.config) for layer in layers for pos in positions]

    def request(self, pair, cell, ctx, source):
        return Request(tokens=_tokens(pair, cell.direction), patches=(Patch(self.site, cell.layer, source, (cell.position,)),),
                       **_scored(pair))


class UnitSweep(SweepKind):
    """One unit (an attention head's slice of z or of q, k or v, or one MLP neuron) per run: at every
    position at once and at the positions of chosen roles, or at every (or given) position one by
    one. A kind may patch several sites (qkv: q, k and v), each unit by unit."""

    def __init__(self, name: str, *sites: str, drawing: str = "layer_by_head"):
        self.name, self.sites, self.drawing = name, sites, drawing
        self.site = sites[0]  # the site a single-site kind patches (atp screens by it)

    def needs(self, ctx):
        streams = (("corrupt", stream_keys(ctx.n_layers)),) if ctx.config.start_midstack else ()
        keys = tuple(k for site in self.sites for k in layer_keys(site, ctx.n_layers))
        return CacheSpec(keys, ("clean",), streams)

    def positions(self, pair, config) -> list[int | None]:
        return unit_positions(pair, config)

    @staticmethod
    def units(site: str, ctx) -> int:
        unit = SITES[site].unit
        n = {"head": ctx.n_heads, "kv_head": ctx.n_kv_heads or ctx.n_heads, "neuron": ctx.d_mlp}[unit]
        if not n:
            raise ValueError(f"a sweep over {site} needs the model's number of {unit}s")
        return n

    def cells(self, pair, ctx):
        return [Cell(self.name, site, "denoise", layer, pos, **{SITES[site].unit_field: unit})
                for site in self.sites for pos in self.positions(pair, ctx.config) for layer in range(ctx.n_layers)
                for unit in range(self.units(site, ctx))]

    def count(self, pair, ctx):
        return len(self.positions(pair, ctx.config)) * ctx.n_layers * sum(self.units(s, ctx) for s in self.sites)

    def request(self, pair, cell, ctx, source):
        positions = None if cell.position is None else (cell.position,)
        field = SITES[cell.site].unit_field
        return Request(tokens=pair.corrupt_ids,
                       patches=(Patch(cell.site, cell.layer, source, positions, **{field: getattr(cell, field)}),),
                       **_scored(pair))


def trace_window(layer: int, window: int, n_layers: int) -> range:
    """Meng et al.'s window: `window` layers centred on `layer`, cut at the model's ends."""
    return range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2)))


class TraceSweep(SweepKind):
    """Causal tracing (Meng et al.): the clean prompt with noise on the subject's embeddings; per
    sample, the noised run itself and one run per restored site. Rows average over samples and
    take the noised run as the corrupt baseline."""

    name, metric, drawing = "trace", "p", "trace_buckets"

    def needs(self, ctx):
        config = ctx.config
        keys = tuple(k for site in config.trace_sites for k in layer_keys(site, ctx.n_layers)) + ("embed",)
        noised = ()
        if config.start_midstack:
            if not ctx.noise_std > 0:
                raise ValueError("causal tracing caches its noised runs to start restored runs from: give the noise "
                                 f"std (cache_spec(..., noise_std); got {ctx.noise_std}), or start_midstack=False")
            noised = tuple((Cell(self.name, None, sample=s).stream, stream_keys(ctx.n_layers))
                           for s in range(config.trace_samples))
        return CacheSpec(keys, ("clean",), noised, (ctx.noise_std, config.seed) if noised else None)

    def cells(self, pair, ctx):
        config, out = ctx.config, []
        positions = _positions(pair, config)
        windowed = [s for s in config.trace_sites if s != "resid"]
        for s in range(config.trace_samples):
            out.append(Cell(self.name, None, sample=s))
            for layer in range(ctx.n_layers):
                for pos in positions:
                    if "resid" in config.trace_sites:
                        out.append(Cell(self.name, "resid", "denoise", layer, pos, sample=s))
                    for site in windowed:
                        out.append(Cell(self.name, site, "denoise", layer, pos, None, config.trace_window, s))
        return out

    def request(self, pair, cell, ctx, source):
        config = ctx.config
        noise = (Noise(pair.subject_positions, ctx.noise_std, trace_seed(config.seed, pair.pair_id, cell.sample)),)
        if cell.site is None:
            patches = ()
        elif cell.window is None:
            patches = (Patch(cell.site, cell.layer, source, (cell.position,)),)
        else:
            patches = tuple(Patch(cell.site, w, source, (cell.position,))
                            for w in trace_window(cell.layer, cell.window, ctx.n_layers))
        return Request(tokens=pair.clean_ids, noise=noise, patches=patches, **_scored(pair))

    def first_change(self, pair):
        return min(pair.subject_positions)  # the noise: the clean prompt's tokens are the same

    def same_run(self, cell):
        return Cell(self.name, None, sample=cell.sample)  # that sample's noised run

    def rows(self, pair, readings, baseline, ctx):
        samples = defaultdict(list)  # restored site (sample dropped) -> its samples' readings
        for cell, r in readings:
            samples[Cell(cell.sweep, cell.site, cell.direction, cell.layer, cell.position, cell.head, cell.window)].append(r)
        noised = Reading.mean(samples.pop(Cell(self.name, None)))
        clean, _ = baselines(baseline)
        out = []
        for cell, got in samples.items():
            row = effect_row(pair, cell, Reading.mean(got), clean, noised, self.metric)
            if cell.window is not None:  # the layers actually restored: the window is cut at the model's ends
                row["window"] = len(trace_window(cell.layer, cell.window, ctx.n_layers))
            out.append(row)
        return out


class AtpSweep(SweepKind):
    """Attribution patching over the cells of the screened kinds (config.atp_kinds, denoise only),
    the top `verify_top` per pair and kind by the ranking score and `verify_random` sampled from the
    rest patched exactly. `ctx.estimates` holds the estimates and the choice (`estimates()` makes them)."""

    name, drawing = "atp", "atp"
    settings = ("atp_kinds", "verify_top", "verify_random", "atp_correction")

    def screened(self, ctx: SweepContext) -> tuple[list[SweepKind], SweepContext]:
        """The kinds screened, and the context their grids are taken in (denoising only)."""
        config = dataclasses.replace(ctx.config, resid_directions=("denoise",))
        return [SWEEP_KINDS[k] for k in ctx.config.atp_kinds], dataclasses.replace(ctx, config=config)

    def needs(self, ctx):
        kinds, inner = self.screened(ctx)
        spec = CacheSpec(())
        for kind in kinds:
            spec = spec.merge(kind.needs(inner))
        return spec

    def grid(self, pair, ctx) -> list[Cell]:
        """Every screened cell, as an atp cell, in grid order."""
        if ctx.estimates is not None:
            return list(ctx.estimates[pair.pair_id])
        kinds, inner = self.screened(ctx)
        return [Cell(self.name, c.site, c.direction, c.layer, c.position, c.head, c.window, c.sample, c.neuron)
                for kind in kinds for c in kind.cells(pair, inner)]

    def estimates(self, attributor, pairs, ctx) -> dict[str, dict[Cell, tuple[float, float | None, str | None]]]:
        """Per pair id, every screened cell's (estimate, GradDrop score or None, why it is patched
        exactly: `top`, `random` or None), in grid order."""
        kinds, _ = self.screened(ctx)
        correction = ctx.config.atp_correction
        got = attributor.estimate(pairs, tuple(kind.site for kind in kinds), correction)
        out = {}
        for pair, est in zip(pairs, got):
            n = len(pair.corrupt_ids)
            values = {site: {k: v.tolist() for k, v in e.items()} for site, e in est.items()}
            cells = {}
            for cell in self.grid(pair, ctx):
                e = values[cell.site]
                pos = n if cell.position is None else cell.position
                unit = cell.head if cell.head is not None else cell.neuron or 0
                gd = e["graddrop"][cell.layer][pos][unit] if "graddrop" in e else None
                cells[cell] = (e["estimate"][cell.layer][pos][unit], gd)
            chosen = self._verify(pair, cells, ctx.config)
            out[pair.pair_id] = {cell: (est_, gd, chosen.get(cell)) for cell, (est_, gd) in cells.items()}
        return out

    @staticmethod
    def _verify(pair, cells: dict, config) -> dict[Cell, str]:
        """The cells patched exactly: per screened kind, the top K by the ranking score (|estimate|,
        or the GradDrop score), then R sampled (seeded by the study seed, the pair and the site) from
        the rest; cell -> `top` or `random`."""
        by_site = defaultdict(list)
        for cell in cells:
            by_site[cell.site].append(cell)
        graddrop = config.atp_correction == "graddrop"
        out = {}
        for site, group in by_site.items():
            ranked = sorted(group, key=lambda c: -(cells[c][1] if graddrop else abs(cells[c][0])))  # stable
            top, rest = ranked[:config.verify_top], ranked[config.verify_top:]
            rng = random.Random(zlib.crc32(f"{config.seed}:{pair.pair_id}:{site}".encode()))
            out.update({c: "top" for c in top})
            out.update({c: "random" for c in rng.sample(rest, min(config.verify_random, len(rest)))})
        return out

    def cells(self, pair, ctx):
        if ctx.estimates is None:
            raise ValueError("the atp sweep's cells depend on its estimates: compute them first (AtpSweep.estimates)")
        return [cell for cell, (_, _, verify) in ctx.estimates[pair.pair_id].items() if verify is not None]

    def count(self, pair, ctx):
        kinds, inner = self.screened(ctx)
        k, r = ctx.config.verify_top, ctx.config.verify_random
        return sum(min(k + r, kind.count(pair, inner)) for kind in kinds)

    def request(self, pair, cell, ctx, source):
        kinds, inner = self.screened(ctx)
        kind = next(k for k in kinds if k.site == cell.site)
        return kind.request(pair, cell, inner, source)

    def rows(self, pair, readings, baseline, ctx):
        clean, corrupt = baselines(baseline)
        metric = self.headline(pair)
        exact = dict(readings)
        out, unpatched = [], None  # the columns every site not patched shares: baselines, NULL patched run
        for cell, (estimate, graddrop, verify) in ctx.estimates[pair.pair_id].items():
            if cell in exact:
                row = effect_row(pair, cell, exact[cell], clean, corrupt, metric)
            else:
                if unpatched is None:
                    unpatched = effect_row(pair, cell, None, clean, corrupt, metric)
                row = {**unpatched, **cell_columns(pair, cell)}
            row.update(estimate=estimate, estimate_graddrop=graddrop, verify=verify)
            out.append(row)
        return out


SWEEP_KINDS: dict[str, SweepKind] = {kind.name: kind for kind in (
    PositionSweep("resid", both_directions=True),
    PositionSweep("resid_pre"),
    PositionSweep("resid_mid"),
    PositionSweep("attn_out"),
    PositionSweep("mlp_out"),
    PositionSweep("embed", layered=False),
    UnitSweep("heads", "head"),
    UnitSweep("neurons", "neuron", drawing="none"),
    UnitSweep("qkv", "q", "k", "v"),
    TraceSweep(),
    AtpSweep(),
)}


from .paths import PathSweep  # noqa: E402  (it builds on the classes above)

SWEEP_KINDS[PathSweep.name] = PathSweep()


def settings_of(names) -> tuple[str, ...]:
    """The SweepConfig fields the sweep kinds `names` read beyond the common ones, in order."""
    return tuple(dict.fromkeys(s for name in names for s in SWEEP_KINDS[name].settings))


def kind_sites(kind: SweepKind) -> tuple[str, ...]:
    """The sites a sweep kind patches one run per coordinate (none for trace, atp and paths)."""
    return getattr(kind, "sites", None) or tuple(s for s in (getattr(kind, "site", None),) if s)


def kind_for_site(site: str) -> SweepKind:
    """The sweep that patches `site` one run per coordinate (what `patchgrid patch` runs; qkv patches
    k and v beside q)."""
    for kind in SWEEP_KINDS.values():
        if site in kind_sites(kind):
            return kind
    raise ValueError(f"no sweep patches site {site!r}")
