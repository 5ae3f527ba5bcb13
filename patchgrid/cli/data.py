"""Commands on data: build a model folder, pair a data set, sweep a pairs table into the warehouse."""
from __future__ import annotations

import sys
from pathlib import Path

from ..pipeline.spec import StudySpec, check_sweep_settings_apply, dtype_option
from ..settings import SpecError
from ..sweeps import SweepConfig
from .common import UsageError
from .options import settings_from

SHOWN_REJECTIONS = 10  # the rejected pairs `pairs check` lists, by id, reason and detail


def cmd_models_prepare(args) -> int:
    from ..model.models import prepare

    print(prepare(args.name))
    return 0


def cmd_pairs_check(args) -> int:
    from ..backends.engine import load_engine
    from ..pairs import build_from_source, read_source, summary, write_pairs

    if args.require_known and Path(args.pairs).is_file():
        read_source(args.pairs, args.pairs_format)  # a file that cannot be read stops here, before an engine starts
    engine = load_engine(args.model, args.backend) if args.require_known else None
    from ..runtime.console import ProgressBars
    from ..runtime.progress import reporting_to

    try:
        with ProgressBars() as bars, reporting_to(bars):  # judging facts, on stderr
            fmt, records, rows = build_from_source(args.model, args.pairs, args.pairs_format, seed=args.seed,
                                                   answer_policy=args.answer_policy, engine=engine)
    finally:
        if engine is not None:
            engine.close()
    out = write_pairs(rows, args.out)
    print(f"{args.pairs}: {len(records)} records, format {fmt}")
    for (status, reason), n in summary(rows).items():
        print(f"  {status:<9} {reason or '':<24} {n:>6}")
    rejected = [r for r in rows if r["status"] == "rejected"]
    if rejected:
        shown = rejected[:SHOWN_REJECTIONS]
        print(f"rejected pairs ({'all' if len(shown) == len(rejected) else f'the first {len(shown)} of'} "
              f"{len(rejected)}; each with its detail in {out}):")
        for r in shown:
            print(f"  {r['pair_id']}  {r['reason']}: {r.get('detail') or ''}".rstrip(": "))
    print(f"wrote {out}")
    return 0


def cmd_sweep(args) -> int:
    """A pairs table swept as a study sweeps its own (patchgrid.pipeline.steps, without Prefect): each
    sweep kind on its population (accepted pairs; for causal tracing, the facts the model knows
    alone), its rows written to --out and loaded into the warehouse as a run of its own."""
    from ..backends.engine import LocalEngines, using_engine
    from ..pairs import read_pairs
    from ..pipeline import steps
    from ..rows.effects import write_effects
    from ..runtime.console import ProgressBars
    from ..runtime.progress import reporting_to, stage
    from ..sweeps import noised
    from ..warehouse.loader import check_writable

    try:
        config = SweepConfig(**settings_from(args, SweepConfig))
        check_sweep_settings_apply(config)  # a kind's setting while that kind does not run
        StudySpec.of(run_id=args.run_id, limit=args.limit)  # the run id's and the limit's own checks
    except SpecError as exc:
        raise UsageError(exc.flag_message) from None
    if not Path(args.pairs_table).is_file():
        raise UsageError(f"--pairs-table {args.pairs_table}: no such file (make one with `patchgrid pairs check`)")
    check_writable(args.warehouse)  # before any work; one not there yet is made when the run loads
    try:
        steps.check_model(args.model, config)  # a site its family lacks, a layer past its last
    except SpecError as exc:
        raise UsageError(exc.flag_message) from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    table = read_pairs(args.pairs_table)
    groups = steps.groups(table, config, args.limit)
    empty = steps.first_empty(groups)
    if empty is not None:
        raise UsageError(_nothing_to_sweep(empty.population, table, args.pairs_table))
    noise = None
    if noised(config.sweeps):  # as a study measures it: over the whole data set's subjects (every row of the table)
        noise = steps.trace_noise(args.model, steps.table_subjects(args.pairs_table), config.trace_noise_scale)
    started = steps.now()
    rows, baselines = [], []
    engines = LocalEngines(args.model, args.backend, dtype_option(args.dtype))
    with engines, ProgressBars() as bars, reporting_to(bars):
        for group in groups:  # the cache and the patched runs of each population, progress on stderr
            std = group.noise_std(noise.std if noise else 0.0)
            need = steps.cache_need(args.model, group.sweep, std)
            cache = steps.activation_cache(engines, group.members, need, args.cache, log=_to_stderr)
            print(f"cache {'built' if cache.built else 'found'}: {cache.folder} "
                  f"({cache.bytes_per_pair / 1e3:.1f} kB per pair)")
            swept, swept_baselines = engines.run(using_engine(steps.sweep_group, group, cache.folder, std,
                                                              progress=stage("patched runs")))
            rows += swept
            baselines += swept_baselines
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # made once there are rows to write
    write_effects(rows, args.out)
    chosen = ", ".join(f"{len(group.members)} {group.population.counted_as}" for group in groups)
    print(f"{chosen}, {len(rows)} effect rows -> {args.out}")
    run_id = load_sweep(args, config, baselines, started, steps.measured(noise, config.sweeps))
    print(f"run {run_id} -> {args.warehouse}")
    return 0


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _nothing_to_sweep(population, table, pairs_table: str) -> str:
    """Why `patchgrid sweep` stops before any work on a population with no members, in one line."""
    why = [f"--pairs-table {pairs_table}: {population.missing.format(pairs='the table')}"]
    if population.fix:
        why.append(population.fix)
    if population.asks_model and all(known is None for known in table.column("known_alone").to_pylist()):
        why.append("the table's facts were not judged by the model: write it with `patchgrid pairs check` "
                   "--require-known")
    return "; ".join(why)


def load_sweep(args, config: SweepConfig, baselines: list[dict], started, measured: dict) -> str:
    """The sweep's rows as a run of the warehouse, as a study loads its own: its pairs table (the
    rejections too), the swept pairs' baselines and the effects file, and its parameters in `runs`;
    a rerun with the same inputs (the same run id: default_run_id's rule) replaces its rows.
    Returns the run id."""
    from ..pipeline import steps
    from ..pipeline.spec import default_run_id, run_params

    model_sha = steps.model_sha256(args.model)
    own = {"command": "sweep", "model": args.model, "pairs_table": str(Path(args.pairs_table).resolve()),
           "limit": args.limit, "backend": args.backend, **dtype_option(args.dtype)}
    run_id = args.run_id or default_run_id("sweep", model_sha, own, config)
    steps.start_run_record(args.warehouse, run_id, args.model, model_sha, {**run_params(own, config), **measured},
                           started)
    steps.load(args.warehouse, run_id, args.pairs_table, baselines, [args.out], finished=steps.now())
    return run_id
