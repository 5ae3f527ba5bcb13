"""What every sweep kind is: its cells (`Cell`), what its grid depends on (`SweepContext`), what
its phases work with (`SweepRun`), and the base class `SweepKind` with the defaults a kind may keep.

A kind's life in `run_sweeps`, each step a method the runner calls on every kind of the run, in
the run's order, naming none:

    settle(ctx, run)    before the cache is checked: what the kind's cache needs depend on
                        (trace: the noise std)
    needs(ctx)          what the activation cache must hold
    prepare(ctx, run)   before the grid runs: work its cells depend on (atp: the estimates;
                        paths: the first pass)
    cells(pair, ctx)    the grid; request(...) the engine request of each cell, unless
                        unchanged(...) or reading_without_run(...) has its reading already
    rows(...)           effect rows from the cells' readings
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cache import NOISED, CacheSpec
from ..frozen import frozen
from ..metrics import METRICS, Reading, reads_of
from ..plan import Request, Start, latest_start, replaced
from ..rows.effects import PairRows, reading_from
from ..rows.shapes import BASE_RUNS
from ..settings import SpecError
from .populations import ACCEPTED_PAIRS, Population

if TYPE_CHECKING:
    from .config import SweepConfig


@frozen
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
    # What else tells a kind's cells apart, as columns of its own row shape that its rows carry, in
    # (column, value) pairs: circuit: (("circuit_size", percent of the graph's edges),); knockout:
    # (("blocked", the group of positions the last position may not read),)
    row_columns: tuple[tuple[str, object], ...] = ()

    def row_column(self, column: str):
        """The value of one of the cell's `row_columns` (None: it has none)."""
        return dict(self.row_columns).get(column)

    @property
    def source(self) -> str:
        """The cached run whose activations the patch writes."""
        return "corrupt" if self.direction == "noise" else "clean"

    @property
    def base_run(self) -> str:
        """The cached run this patched run equals below its patches (where it may start): the run
        its direction goes into (rows.shapes.BASE_RUNS), or for causal tracing the noised run of its sample."""
        if self.sample is not None:
            return f"{NOISED}{self.sample}"
        return BASE_RUNS[self.direction]


@dataclass(frozen=True)
class SweepContext:
    """What a sweep's grid depends on besides the pair."""

    config: SweepConfig
    n_layers: int
    n_heads: int
    noise_std: float = 0.0  # the noise a noised kind's runs add (trace; settled by TraceSweep.settle)
    d_mlp: int = 0  # neurons per layer
    n_kv_heads: int = 0  # key/value heads per layer; 0: as many as heads
    # what each kind's prepare phase computed, by kind name (atp: its estimates and choice; paths:
    # its first pass's readings)
    prepared: dict | None = None
    # activations of runs a phase made, by (pair id, run name): sources later requests patch from
    # (paths: the first pass's captures)
    derived: dict | None = None

    def prepared_by(self, name: str):
        """What kind `name`'s prepare phase left in the context (None: it has not run)."""
        return (self.prepared or {}).get(name)

    def with_prepared(self, name: str, value, derived: dict | None = None) -> SweepContext:
        return dataclasses.replace(self, prepared={**(self.prepared or {}), name: value},
                                   derived={**(self.derived or {}), **derived} if derived else self.derived)


Run = tuple  # (pair index, kind, cell, request): one engine run of a sweep
Read = Callable[[Run, object], None]  # handed each run and its engine result


@dataclass
class SweepRun:
    """What a kind's phases work with: the run's engine, pairs and cached activations."""

    engine: object
    pairs: list
    store: object  # an ActivationCache or a MemoryStore
    noise_std: float | None = None  # the noise std given for the pairs' whole data set (run_sweeps)
    attributor: object = None  # what gradients are taken on (patchgrid.methods.attribution); None: the default
    # engine calls over runs, each result handed to `read`; not counted as the grid's progress
    run: Callable[[list[Run], Read, SweepContext], None] | None = None


class SweepKind:
    name: str
    metric = "logit_diff"  # the headline metric (an effect row's `effect` and `recovery`)
    # The shape of its effect rows (a name of rows.shapes.EFFECT_SHAPES: the columns they have, and
    # which views read them)
    row_shape = "exact"
    # How the report draws the kind's rows: a name of patchgrid.report.sections.DRAWINGS, or none (not
    # drawn: a cell per neuron)
    drawing = "layer_by_role"
    # The SweepConfig fields the kind reads beyond the common ones (settings_of): what a run
    # records only when one of its kinds reads it
    settings: tuple[str, ...] = ()
    # The sites it patches one run per coordinate (kind_for_site: what `patchgrid patch` runs)
    sites: tuple[str, ...] = ()
    # What a study runs it on (populations: accepted pairs, or the facts the model knows alone)
    population: Population = ACCEPTED_PAIRS
    # Its runs add noise to the embeddings, whose std a study measures once over the data set's
    # subjects (sweeps.noise) and hands to every shard (run_sweeps' noise_std)
    noised = False
    # The kinds it builds on, which must run before it in the same run (config.check_sweep_needs), and why
    builds_on: tuple[str, ...] = ()
    builds_on_why = ""
    # Whether its patches can take the mean or zero instead of the other run's value (config.ablation),
    # and if not, why
    ablatable = False
    ablatable_why = "its patches are defined by the other run's values"
    # Its work spans the run's pairs at once (circuit: one circuit from every pair's edge scores): a
    # study runs it in one shard (registry.spans_data_set)
    spans_data_set = False

    def headline(self, pair) -> str:
        """The headline metric for `pair`: a pair whose answers are scored whole has no logit
        difference, and takes the log-probability difference instead."""
        if self.metric == "logit_diff" and (len(pair.clean_answer_ids) > 1 or len(pair.corrupt_answer_ids) > 1):
            return "logprob_diff"
        return self.metric

    def metrics_read(self, pair, config) -> tuple[str, ...]:
        """The metrics its patched runs of `pair` read: the study's (config.metrics) and its headline."""
        head = self.headline(pair)
        return tuple(m for m in METRICS if m in config.metrics or m == head)

    def family_sites(self, config) -> tuple[str, ...]:
        """The sites the model's family must have for this kind to run (check_family)."""
        return self.sites

    def family_refusal(self, family) -> str | None:
        """Why the kind cannot run on the model's family at all, beyond its sites (check_family); None: it can."""
        return None

    # ---- phases (optional) ----
    def settle(self, ctx: SweepContext, run: SweepRun) -> SweepContext:
        """Before the cache is checked: what the kind's `needs` depend on, from the run."""
        return ctx

    def prepare(self, ctx: SweepContext, run: SweepRun) -> SweepContext:
        """After the cache is checked, before the grid runs: what the kind's cells depend on."""
        return ctx

    # ---- the grid ----
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

    def patch_source(self, index: int, cell: Cell, ctx: SweepContext) -> str:
        """The source `cell`'s request of pair `index` patches from (source_name): its source run's
        values, or with `config.ablation` their mean or zeros where the kind takes it."""
        return source_name(index, self.source_run(cell), ctx.config.ablation if self.ablatable else "patching")

    def reading_without_run(self, cell: Cell, ctx: SweepContext, pair) -> Reading | None:
        """A reading `cell` already has without a run of its own, from a phase (None: run it)."""
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
        row = PairRows(pair, *baselines(baseline), self.headline(pair)).row
        return [row(cell, r) for cell, r in readings]


def as_runs(index: int, ctx: SweepContext, metrics: tuple[str, ...]) -> Callable[[Request, Cell], Request]:
    """What makes a kind's request of `cell` the run the engine gets for pair `index` (what the pair's
    runs share made once): with `config.start_midstack` starting at the latest layer its patches
    allow, from the stream of the run it equals below them, and reading what `metrics`
    (SweepKind.metrics_read) need and no more: its KL divergence from the clean run's
    (`{index}:clean`), the answers' ranks, the answers scored whole (kept for answers of several
    tokens, whose first tokens alone are no logit difference: metrics.Reading.of)."""
    reads = reads_of(metrics)
    reference = f"{index}:clean" if "reference" in reads else None
    ranks, continuations = "ranks" in reads, "continuations" in reads
    midstack, n_layers, starts = ctx.config.start_midstack, ctx.n_layers, {}

    def run(req: Request, cell: Cell) -> Request:
        layer = latest_start(req.patches, n_layers, req.knockout) if midstack and req.circuit is None else 0
        start = None
        if layer > 0:
            start = starts.get((layer, cell.base_run))
            if start is None:
                start = starts[layer, cell.base_run] = Start(layer, f"{index}:{cell.base_run}")
        whole = continuations or any(len(c) > 1 for c in req.continuations)
        return replaced(req, start=start, reference=reference, ranks=ranks,
                        continuations=req.continuations if whole else ())

    return run


def source_name(index: int, run: str, ablation: str = "patching") -> str:
    """The name a request gives the values it patches in for pair `index`: the cached run `run`'s
    (`{index}:{run}`), their mean over the run's pairs at each position role (`{index}:{run}~mean`), or
    zeros (`{index}:~zero`); sweeps.run._source reads them."""
    if ablation == "patching":
        return f"{index}:{run}"
    if ablation == "mean":
        return f"{index}:{run}~mean"
    if ablation == "zero":
        return f"{index}:~zero"
    raise KeyError(ablation)


def baselines(row: dict) -> tuple[Reading, Reading]:
    """A baseline row (rows.BASELINE) as the clean and corrupt runs' readings."""
    return reading_from(row, "clean"), reading_from(row, "corrupt")


def grid_layers(ctx: SweepContext) -> list[int]:
    """The layers a grid patches: the given ones (config.layers), or every layer of the model; a layer
    the model does not have is refused (check_layers)."""
    check_layers(ctx.config, ctx.n_layers)
    return list(range(ctx.n_layers)) if ctx.config.layers is None else list(ctx.config.layers)


def check_layers(config, n_layers: int, model: str = "the model") -> None:
    """Refuse given layers (config.layers) past the model's last, naming the setting and its count."""
    past = [layer for layer in config.layers or () if layer >= n_layers]
    if past:
        raise SpecError("layers", f"{{name}} {past[0]}: {model} has {n_layers} layers (0-{n_layers - 1})")


def given_positions(pair, config) -> list[int]:
    """The given positions (config.positions) that the pair's prompt has."""
    return [p for p in config.positions if p < len(pair.clean_ids)]


def every_position(pair, config) -> list[int]:
    """The positions patched one by one: the given ones, or every position of the prompt."""
    return list(range(len(pair.clean_ids))) if config.positions is None else given_positions(pair, config)


def unit_positions(pair, config) -> list[int | None]:
    """Where heads, neurons and paths are patched: the given positions one by one; or every position
    one by one (head_positions `every`); or every position at once (None) and the positions of the
    head_position_roles."""
    if config.positions is not None:
        return given_positions(pair, config)
    if config.head_positions == "every":
        return list(range(len(pair.corrupt_ids)))
    chosen = [None] + [pair.roles.index(role) for role in config.head_position_roles if role in pair.roles]
    return list(dict.fromkeys(chosen))


def scored(pair) -> dict:
    """What every run of a pair reads: both answers' first tokens at the last prompt position, and
    both answers scored whole after it."""
    return dict(answers=pair.answers, continuations=pair.continuations)


def trace_window(layer: int, window: int, n_layers: int) -> range:
    """Meng et al.'s window: `window` layers centred on `layer`, cut at the model's ends."""
    return range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2)))
