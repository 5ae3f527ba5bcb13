"""A run's steps, each a plain function that does the computing: the model checked, the trace noise
measured, the pairs table written, each sweep kind's population chosen, the activation cache found
or built, the sweeps run, the run recorded and loaded into the warehouse. Two drivers call them: the
`study` flow (flows/study.py, each step a Prefect task of patchgrid.tasks, which adds its caching,
retries, logging and artifacts, and nothing else) and `patchgrid sweep` (patchgrid/cli/data.py,
directly, without Prefect).

Heavy libraries (torch, transformers, pyarrow) are imported where a step runs: the command line
imports this module to parse arguments.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ..backends.engine import Engines, using_engine
from ..runtime.progress import Progress, stage
from ..sweeps import Population, SweepConfig, by_population, noised, spans_data_set
from .spec import ShardSpec, StudySpec

if TYPE_CHECKING:
    import pyarrow as pa

    from ..cache import CacheSpec
    from ..model.sites import ModelShape
    from ..pairs import Limit, Pair
    from ..sweeps import TraceNoise


def now() -> datetime:
    """The time a run records (started, finished): UTC, without its zone, as the warehouse keeps it."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def code_version() -> str:
    """patchgrid's version and, in a git checkout, its commit: what a run records as its code."""
    import patchgrid

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{patchgrid.__version__}+{rev}" if rev else patchgrid.__version__


# -- the model -----------------------------------------------------------------------------------

@lru_cache(maxsize=16)
def model_shape(model: str) -> ModelShape:
    """The model's shape (family, layers, ...), read from its config once per process, without loading it."""
    from transformers import AutoConfig

    from ..model.models import prepare
    from ..model.sites import shape_of

    return shape_of(AutoConfig.from_pretrained(prepare(model), trust_remote_code=False))


def model_sha256(model: str) -> str:
    """The sha256 of the model's weights: what a run's id and its task caches are derived from."""
    from ..cache import model_identity
    from ..model.models import prepare

    return model_identity(prepare(model))["weights_sha256"]


def check_model(model: str, sweep: SweepConfig) -> None:
    """Refuse, before any engine starts, sweeps the model cannot run: a site its family lacks
    (ValueError) or a given layer past its last (SpecError, naming the setting)."""
    from ..sweeps import check_family
    from ..sweeps.base import check_layers

    shape = model_shape(model)
    check_family(sweep, shape.family)
    check_layers(sweep, shape.n_layers, model)


# -- the trace noise -----------------------------------------------------------------------------

def noise_inputs(spec: StudySpec) -> dict:
    """What a study's trace noise depends on: the model's embeddings of the data set's subjects, and its scale."""
    return dict(model=spec.model, source=spec.pairs, fmt=spec.pairs_format, scale=spec.sweep.trace_noise_scale)


def data_set_subjects(source: str, fmt: str | None) -> list[str]:
    """Every record's subject, read from a data set."""
    from ..pairs import read_source

    _, records = read_source(source, fmt)
    return [r.subject for r in records]


def table_subjects(pairs_table: str) -> list[str]:
    """Every record's subject, read from a pairs table (one row per record of its data set, rejected too)."""
    import pyarrow.parquet as pq

    return pq.read_table(pairs_table, columns=["subject"]).column("subject").to_pylist()


def trace_noise(model: str, subjects: list[str], scale: float) -> TraceNoise:
    """The causal-tracing noise over a whole data set's `subjects` (`scale` x the std of their token
    embeddings), the same whatever pairs a run keeps. It reads the embedding matrix from the weight
    files; no model is loaded."""
    from ..model.models import prepare
    from ..sweeps import subject_noise

    return subject_noise(prepare(model), subjects, scale)


def measured(noise: TraceNoise | None, sweeps) -> dict:
    """What a run derived from its inputs, recorded beside its parameters: the trace noise, and what
    each population of its sweep kinds records of itself (causal tracing's facts), when noised."""
    if noise is None:
        return {}
    return {**noise.recorded(), **{key: what for population, _ in by_population(sweeps)
                                   for key, what in population.recorded}}


# -- the run record ------------------------------------------------------------------------------

def start_run_record(warehouse: str, run_id: str, model: str, model_sha256: str, params: dict, started,
                     flow_run_id: str | None = None) -> None:
    """The run, recorded as running, with its parameters and the code that runs it."""
    from ..warehouse.loader import start_run

    start_run(warehouse, {"run_id": run_id, "flow_run_id": flow_run_id, "model": model, "model_hash": model_sha256,
                          "params": params, "code_version": code_version(), "started": started})


# -- the pairs -----------------------------------------------------------------------------------

def pairing_inputs(spec: StudySpec) -> dict:
    """What a run's pairs table depends on: the data set, the model and how pairs are chosen; the
    model is asked when pairs must be known, and when a sweep kind's population needs its
    predictions (causal tracing's facts known alone). Where it is asked, the study's limit says how
    far judging goes: until the first N members of each of the study's populations are found."""
    from ..sweeps import POPULATIONS, SWEEP_KINDS, aligning_asks_model

    ask = spec.require_known or aligning_asks_model(spec.sweeps)
    populations = {SWEEP_KINDS[name].population for name in spec.sweeps}
    until = tuple(p.name for p in POPULATIONS if p in populations) if ask and spec.limit is not None else ()
    # a population chosen by a rule (causal tracing's trace_facts) is judged until N members under it
    rules = {p.rule: getattr(spec.sweep, p.rule) for p in POPULATIONS if p.name in until and p.rule}
    return dict(**spec.engine_identity(), source=spec.pairs, fmt=spec.pairs_format,
                seed=spec.sweep.seed, require_known=spec.require_known, answer_policy=spec.answer_policy,
                ask_model=ask, limit=spec.limit if until else None, until=until, rules=rules)


def judging_limit(v: dict) -> Limit | None:
    """The pairs layer's Limit for `pairing_inputs` `v`: N members of each population named in `until`."""
    from functools import partial

    from ..pairs import Limit
    from ..sweeps import POPULATIONS

    if v["limit"] is None:
        return None
    chosen = [p for p in POPULATIONS if p.name in v["until"]]
    config = SweepConfig(**v.get("rules", {}))
    return Limit(v["limit"], tuple(partial(p.members, config=config) for p in chosen),
                 tuple(p.counted_as for p in chosen))


class PairsWritten(NamedTuple):
    out: str
    fmt: str  # the data set's format
    records: int  # records read
    counts: dict  # (status, reason) -> rows


def write_pairs_table(v: dict, out: str, engines: Engines) -> PairsWritten:
    """The pairs step: read the data set of `pairing_inputs` `v`, pair and align it with the model's
    tokenizer and write the pairs table to `out`. Where the model is asked, that runs where the
    engines run."""
    from ..pairs import build_from_source, summary, write_pairs

    args = (v["model"], v["source"], v["fmt"])
    kwargs = dict(seed=v["seed"], require_known=v["require_known"], answer_policy=v["answer_policy"],
                  limit=judging_limit(v))
    if v["ask_model"]:
        fmt, records, rows = engines.run(using_engine(build_from_source, *args, **kwargs))
    else:
        fmt, records, rows = build_from_source(*args, engine=None, **kwargs)
    write_pairs(rows, out)  # its folder made when missing
    return PairsWritten(out, fmt, len(records), summary(rows))


# -- the populations -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Group:
    """The sweep kinds a run runs on one population, and that population's members."""

    population: Population
    sweep: SweepConfig  # the run's settings, its kinds this population's
    members: list[Pair]

    @property
    def names(self) -> tuple[str, ...]:
        return self.sweep.sweeps

    def noise_std(self, std: float) -> float:
        """The trace noise its kinds' runs add: `std` (the run's) where one of them adds noise, else 0."""
        return std if noised(self.names) else 0.0


def groups(table: pa.Table, sweep: SweepConfig, limit: int | None) -> list[Group]:
    """Each sweep kind of `sweep` grouped by the population it runs on (accepted pairs; for causal
    tracing, the facts the model knows alone, partner or not, under the run's trace_facts rule),
    each with its first `limit` members in the pairs `table`: every population is chosen before any
    work. A group may be empty (first_empty)."""
    return [Group(population, replace(sweep, sweeps=names), population.members(table, limit, sweep))
            for population, names in by_population(sweep.sweeps)]


def first_empty(chosen: list[Group]) -> Group | None:
    """The first group with nothing to run on, if any: the run stops there."""
    return next((g for g in chosen if not g.members), None)


# -- the activation cache ------------------------------------------------------------------------

def cache_need(model: str, sweep: SweepConfig, noise_std: float = 0.0) -> CacheSpec:
    """What an activation cache must hold for the sweeps of `sweep`: every site and run they read,
    and the noised runs, drawn with `noise_std`."""
    from ..sweeps import cache_spec

    return cache_spec(sweep, model_shape(model).n_layers, noise_std)


def cache_inputs(spec: StudySpec, sweeps: tuple[str, ...], noise_std: float = 0.0) -> dict:
    """What a study's activation cache holds: the engine that captures it and the cache specification
    the sweeps `sweeps` need (every site and run they read, the noise of the noised runs)."""
    return dict(**spec.engine_identity(),
                cache=cache_need(spec.model, replace(spec.sweep, sweeps=tuple(sweeps)), noise_std))


class CacheFound(NamedTuple):
    folder: str
    built: bool  # False: found, its clean forwards not run again
    bytes_per_pair: float


def found_or_built(pairs: list[Pair], need: CacheSpec, root: str, *, engine, log=None) -> CacheFound:
    """The cache folder under `root` covering `need` for `pairs`, found or built on `engine`: plain
    values, which cross back from an engine actor. `log`: told of a damaged cache discarded (print where
    none is given, here: a Ray driver replaces `print`, which then cannot travel to an actor)."""
    from ..cache import load_or_build

    cache, built = load_or_build(engine, pairs, need, Path(root), log=log or print,
                                 progress=stage("activation cache (pairs captured)"))
    return CacheFound(str(cache.folder), built, cache.bytes_per_pair)


def activation_cache(engines: Engines, pairs: list[Pair], need: CacheSpec, root: str, log=None) -> CacheFound:
    """The cache step: capture each pair's clean (and corrupt, and noised) runs once, the sites the
    sweeps read and the streams their patched runs start from, where the engines run."""
    return engines.run(using_engine(found_or_built, list(pairs), need, root, log=log))


def cache_is_sound(folder: str) -> bool:
    """Whether a cache folder is as it was written (its checksums): a damaged one is built again."""
    from ..cache import damage

    return damage(folder) is None


# -- the sweeps ----------------------------------------------------------------------------------

def shards_of(group: Group, cache_folder: str, noise_std: float, out_dir: Path, shard_size: int, *, first: int = 0,
              attribution: dict | None = None) -> list[ShardSpec]:
    """A group's members in shards of `shard_size` (one shard for a kind over the pairs at once,
    circuit: one circuit from every pair's edge scores), numbered from `first`."""
    from .shards import split

    size = len(group.members) if spans_data_set(group.names) else shard_size
    return split(group.members, size, cache_folder, group.sweep, noise_std, out_dir, first=first,
                 name=group.population.shard_name, writes_baselines=group.population.writes_baselines,
                 attribution=attribution)


def sweep_shard(shard: ShardSpec, engines: Engines) -> int | None:
    """The sweeps step, one shard where the engines run: its effects file written (its engine's
    provenance beside it, for a shard run in an engine actor); its number of effect rows, or None
    where an earlier attempt of this same shard wrote it whole (a rename)."""
    from .shards import compute_shard

    if Path(shard.out).is_file():
        return None
    # a shard run in an engine actor reports nothing there: its driver counts shards done
    progress = stage(f"patched runs ({Path(shard.out).stem})")
    return engines.run(using_engine(compute_shard, shard=shard, progress=progress),
                       provenance=shard.out + ".engine.json")


def sweep_group(group: Group, cache_folder: str, noise_std: float, *, engine,
                progress: Progress | None = None) -> tuple[list[dict], list[dict]]:
    """The sweeps step, a group's members at once on `engine`, from their cache: the effect rows,
    and the members' baselines where the population writes them (tracing's facts have none)."""
    from ..cache import ActivationCache
    from ..sweeps import run_sweeps

    cache = ActivationCache(Path(cache_folder))
    rows = run_sweeps(engine, group.members, cache, group.sweep, noise_std=noise_std, progress=progress)
    baselines = [cache.baselines[p.pair_id] for p in group.members] if group.population.writes_baselines else []
    return rows, baselines


# -- the warehouse -------------------------------------------------------------------------------

def read_baselines(files: list[str]) -> pa.Table:
    """The baselines the shards wrote, as one table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..rows.shapes import BASELINE

    return pa.concat_tables([pq.read_table(f, schema=BASELINE.schema) for f in files]) if files else BASELINE.table([])


def load(warehouse: str, run_id: str, pairs_table: str, baselines, effect_files: list[str], *, finished,
         status: str = "completed") -> dict:
    """The load step: the run's pairs table (every record, rejections too), its baselines (rows or a
    table) and its effect files into the warehouse in one transaction, replacing its earlier load,
    never duplicating it; the run recorded as `status`. Returns the counts of rows loaded."""
    from ..pairs import read_pairs
    from ..sweeps.registry import row_shapes
    from ..warehouse.loader import load_run

    # each kind's row shape (SweepKind.row_shape): the warehouse files its rows by it, its views select them by it
    return load_run(warehouse, run_id, read_pairs(pairs_table), baselines, effect_files, finished=finished,
                    status=status, sweep_kinds=row_shapes(), progress=stage("warehouse load (files)"))
