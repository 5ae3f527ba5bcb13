"""Commands on data: build a model folder, pair a data set, sweep a pairs table into the warehouse."""
from __future__ import annotations

import sys
from datetime import datetime, timezone
from pathlib import Path

from ..pipeline.spec import StudySpec, check_sweep_settings_apply
from ..settings import SpecError
from ..sweeps import SweepConfig
from .common import UsageError
from .options import settings_from


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
    print(f"wrote {out}")
    return 0


def cmd_sweep(args) -> int:
    from ..backends.engine import load_engine
    from ..cache import load_or_build
    from ..model.models import prepare
    from ..pairs import accepted_pairs, read_pairs
    from ..rows.effects import write_effects
    from ..sweeps import cache_spec, check_family, noised, run_sweeps, subject_noise
    from ..warehouse.loader import check_writable

    try:
        config = SweepConfig(**settings_from(args, SweepConfig))
        check_sweep_settings_apply(config)  # a kind's setting while that kind does not run
        StudySpec.of(run_id=args.run_id)  # the run id's own check
    except SpecError as exc:
        raise UsageError(exc.flag_message) from None
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit} must be at least 1")
    if not Path(args.pairs_table).is_file():
        raise UsageError(f"--pairs-table {args.pairs_table}: no such file (make one with `patchgrid pairs check`)")
    check_writable(args.warehouse)  # before any work; one not there yet is made when the run loads
    pairs = accepted_pairs(read_pairs(args.pairs_table), args.limit)
    if not pairs:
        raise UsageError(f"--pairs-table {args.pairs_table}: holds no accepted pairs")
    noise = None
    if noised(config.sweeps):  # as a study does: over the whole data set
        import pyarrow.parquet as pq

        # as a study measures it: over the whole data set's subjects (every row of the table)
        subjects = pq.read_table(args.pairs_table, columns=["subject"]).column("subject").to_pylist()
        noise = subject_noise(prepare(args.model), subjects, config.trace_noise_scale)
    noise_std = noise.std if noise else 0.0
    started = _now()
    engine = load_engine(args.model, args.backend)
    try:
        try:
            check_family(config, engine.shape.family)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        from ..runtime.console import ProgressBars
        from ..runtime.progress import reporting_to, stage

        with ProgressBars() as bars, reporting_to(bars):  # the cache and the patched runs, on stderr
            cache, built = load_or_build(engine, pairs, cache_spec(config, engine.shape.n_layers, noise_std),
                                         Path(args.cache), log=lambda msg: print(msg, file=sys.stderr),
                                         progress=stage("activation cache (pairs captured)"))
            print(f"cache {'built' if built else 'found'}: {cache.folder} "
                  f"({cache.bytes_per_pair / 1e3:.1f} kB per pair)")
            rows = run_sweeps(engine, pairs, cache, config, noise_std=noise_std, progress=stage("patched runs"))
    finally:
        engine.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # made once there are rows to write
    write_effects(rows, args.out)
    print(f"{len(pairs)} pairs, {len(rows)} effect rows -> {args.out}")
    measured = noise.recorded() if noise else {}
    run_id = load_sweep(args, config, [cache.baselines[p.pair_id] for p in pairs], started, measured)
    print(f"run {run_id} -> {args.warehouse}")
    return 0


def _now():
    return datetime.now(timezone.utc).replace(tzinfo=None)


def load_sweep(args, config: SweepConfig, baselines: list[dict], started, measured: dict) -> str:
    """The sweep's rows as a run of the warehouse, as a study loads its own: its pairs table (the
    rejections too), the swept pairs' baselines and the effects file, and its parameters in `runs`;
    a rerun with the same inputs (the same run id) replaces its rows. Returns the run id."""
    from ..cache import model_identity
    from ..flows.study import code_version
    from ..model.models import prepare
    from ..pairs import read_pairs
    from ..pipeline.fingerprint import fingerprint
    from ..settings import recorded
    from ..sweeps import SWEEP_KINDS, settings_of
    from ..warehouse.loader import load_run, start_run

    model_sha = model_identity(prepare(args.model))["weights_sha256"]
    own = {"command": "sweep", "model": args.model, "pairs_table": str(Path(args.pairs_table).resolve()),
           "limit": args.limit, "backend": args.backend}
    params = {**own, **recorded(config, set(settings_of(config.sweeps)))}
    identity = {**own, **recorded(config, set(settings_of(config.sweeps)), noted=False)}
    run_id = args.run_id or "sweep-" + fingerprint(model_sha, identity)[:12]
    start_run(args.warehouse, {"run_id": run_id, "flow_run_id": None, "model": args.model, "model_hash": model_sha,
                               "params": {**params, **measured}, "code_version": code_version(),
                               "started": started})
    load_run(args.warehouse, run_id, read_pairs(args.pairs_table), baselines, [args.out], finished=_now(),
             sweep_kinds={name: kind.drawing for name, kind in SWEEP_KINDS.items()})
    return run_id
