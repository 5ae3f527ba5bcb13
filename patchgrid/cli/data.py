"""Commands on data: build a model folder, pair a data set, sweep a pairs table."""
from __future__ import annotations

import sys
from pathlib import Path

from ..settings import SpecError
from ..sweeps import SweepConfig
from .common import UsageError
from .options import settings_from


def cmd_models_prepare(args) -> int:
    from ..models import prepare

    print(prepare(args.name))
    return 0


def cmd_pairs_check(args) -> int:
    from ..engine import load_engine
    from ..pairs import build_from_source, summary, write_pairs

    engine = load_engine(args.model, args.backend) if args.require_known else None
    try:
        fmt, records, rows = build_from_source(args.model, args.source, args.pairs_format, seed=args.seed,
                                               answer_policy=args.answer_policy, engine=engine)
    finally:
        if engine is not None:
            engine.close()
    out = write_pairs(rows, args.out)
    print(f"{args.source}: {len(records)} records, format {fmt}")
    for (status, reason), n in summary(rows).items():
        print(f"  {status:<9} {reason or '':<24} {n:>6}")
    print(f"wrote {out}")
    return 0


def cmd_sweep(args) -> int:
    from ..cache import load_or_build
    from ..effects import write_effects
    from ..engine import load_engine
    from ..models import prepare
    from ..pairs import accepted_pairs, read_pairs
    from ..sweeps import cache_spec, check_family, noised, run_sweeps, subject_noise

    try:
        config = SweepConfig(**settings_from(args, SweepConfig))
    except SpecError as exc:
        raise UsageError(exc.flag_message) from None
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit} must be at least 1")
    if not Path(args.pairs).is_file():
        raise UsageError(f"--pairs {args.pairs}: no such file (make one with `patchgrid pairs check`)")
    pairs = accepted_pairs(read_pairs(args.pairs), args.limit)
    if not pairs:
        raise UsageError(f"--pairs {args.pairs}: holds no accepted pairs")
    noise_std = 0.0
    if noised(config.sweeps):  # as a study does: over the whole data set
        import pyarrow.parquet as pq

        # as a study measures it: over the whole data set's subjects (every row of the table)
        subjects = pq.read_table(args.pairs, columns=["subject"]).column("subject").to_pylist()
        noise_std = subject_noise(prepare(args.model), subjects, config.trace_noise_scale).std
    engine = load_engine(args.model, args.backend)
    try:
        try:
            check_family(config, engine.shape.family)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        cache, built = load_or_build(engine, pairs, cache_spec(config, engine.shape.n_layers, noise_std),
                                     Path(args.cache), log=lambda msg: print(msg, file=sys.stderr))
        print(f"cache {'built' if built else 'found'}: {cache.folder} ({cache.bytes_per_pair / 1e3:.1f} kB per pair)")
        rows = run_sweeps(engine, pairs, cache, config, noise_std=noise_std,
                          progress=lambda done, total: print(f"\r{done}/{total} patched runs", end="",
                                                             file=sys.stderr))
        print(file=sys.stderr)
    finally:
        engine.close()
    write_effects(rows, args.out)
    print(f"{len(pairs)} pairs, {len(rows)} effect rows -> {args.out}")
    return 0


