"""The `patchgrid` command line. Input is validated here; the library takes plain values."""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from .console import (
    ProgressBar,
    fixed,
    format_patch_table,
    format_paths_table,
    format_rows,
    one_line_failures,
    quiet_engine_logs,
    quiet_prefect,
)
from .engine import BACKENDS, DEFAULT_BACKEND, DTYPES
from .models import BUILTIN, DEFAULT_MODEL
from .pairs.sources import FORMATS
from .rows import ANSWER_POLICIES
from .sites import PATCHABLE
from .spec import RUNNERS, SpecError, StudySpec, sweep_names
from .sweeps import DEFAULT_SWEEPS, SWEEPS
from .sweeps.config import ATP_CORRECTIONS, ATP_KINDS, HEAD_POSITIONS
from .sweeps.paths import PATH_MLPS

DEFAULT_STUDY = StudySpec()
ANSWER_POLICY_HELP = ("full: score a multi-token answer whole (teacher-forced); single: reject multi-token answers; "
                      "first-token: keep their first token (the policy is recorded per pair)")
NO_SKIP_HELP = ("run every layer of every patched run (default: start each at its lowest patched layer from the "
                "cached stream below it; the numbers are the same)")

DEMO = dict(clean="The capital of France is", corrupt="The capital of Germany is",
            clean_answer=" Paris", corrupt_answer=" Berlin")


class UsageError(Exception):
    pass


def _positions(text: str | None):
    if text is None or text == "all":
        return None
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise UsageError(f"--position {text!r} is not a position number, a comma list, or 'all'") from None


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    from .models import prepare

    return AutoTokenizer.from_pretrained(prepare(model), trust_remote_code=False)


def cmd_models_prepare(args) -> int:
    from .models import prepare

    print(prepare(args.name))
    return 0


def cmd_patch(args) -> int:
    from .engine import load_engine
    from .patching import sweep_pair, tokenize_pair

    positions = _positions(args.position)
    # Everything about the pair is checked before an engine starts.
    pair = tokenize_pair(_tokenizer(args.model), args.clean, args.corrupt, args.clean_answer, args.corrupt_answer)
    for p in positions or ():
        if not 0 <= p < len(pair.clean):
            raise UsageError(f"--position {p} is out of range (the prompts have {len(pair.clean)} tokens)")
    engine = load_engine(args.model, args.backend, dtype=args.dtype)
    try:
        out = sweep_pair(engine, pair, args.site, positions)
    finally:
        engine.close()
    print(json.dumps(out) if args.json else format_patch_table(out, pair.clean_strs, args.top))
    return 0


def cmd_paths(args) -> int:
    from .engine import load_engine
    from .patching import paths_pair, tokenize_pair

    pair = tokenize_pair(_tokenizer(args.model), args.clean, args.corrupt, args.clean_answer, args.corrupt_answer)
    positions = None if args.position == "roles" else _positions(args.position)
    if positions is None and args.position != "roles":  # all: every position one by one
        positions = list(range(len(pair.clean)))
    for p in positions or ():
        if not 0 <= p < len(pair.clean):
            raise UsageError(f"--position {p} is out of range (the prompts have {len(pair.clean)} tokens)")
    from .sweeps import SweepConfig

    settings = path_settings(args)
    try:  # the settings' own checks, before an engine starts
        SweepConfig(sweeps=("paths",), **settings)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    engine = load_engine(args.model, args.backend, dtype=args.dtype)
    try:
        out = paths_pair(engine, pair, settings["path_senders"], settings["path_receivers"], settings["path_inputs"],
                         settings["path_mlps"], positions)
    finally:
        engine.close()
    print(json.dumps(out) if args.json else format_paths_table(out, pair.clean_strs, args.top))
    return 0


def cmd_demo(args) -> int:
    from .engine import load_engine
    from .patching import recovery, sweep_pair, tokenize_pair

    pair = tokenize_pair(_tokenizer(args.model), **DEMO)
    engine = load_engine(args.model, args.backend)
    try:
        out = sweep_pair(engine, pair, "resid")
    finally:
        engine.close()
    toks = pair.clean_strs
    subject = next(i for i, (a, b) in enumerate(zip(pair.clean, pair.corrupt)) if a != b)
    last = len(toks) - 1
    base = out["baseline"]
    print(f"model {args.model}: clean {DEMO['clean']!r} -> {DEMO['clean_answer']!r}, "
          f"corrupt {DEMO['corrupt']!r} -> {DEMO['corrupt_answer']!r}")
    print(f"logit difference (Paris - Berlin): clean {base['clean']:+.3f}, corrupt {base['corrupt']:+.3f}")
    print("recovery = (patched - corrupt) / (clean - corrupt) after patching the clean resid stream into the "
          "corrupt run")
    print(f"{'layer':>5}  {'subject ' + repr(toks[subject]):>18}  {'last ' + repr(toks[last]):>14}")
    by = {(e["layer"], e["position"]): e["logit_diff"] for e in out["effects"]}
    for layer in range(engine.shape.n_layers):
        print(f"{layer:>5}  {fixed(recovery(by[layer, subject], base), '>18.2f')}  "
              f"{fixed(recovery(by[layer, last], base), '>14.2f')}")
    if args.quick:
        return 0
    print()
    return cmd_demo_study(args)


def cmd_pairs_check(args) -> int:
    from .engine import load_engine
    from .pairs import build_from_source, summary, write_pairs

    engine = load_engine(args.model, args.backend) if args.require_known else None
    try:
        fmt, records, rows = build_from_source(args.model, args.source, args.format, seed=args.seed,
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
    from .cache import load_or_build
    from .effects import write_effects
    from .engine import load_engine
    from .models import prepare
    from .pairs import accepted_pairs, read_pairs
    from .sweeps import SweepConfig, cache_spec, check_family, run_sweeps, subject_noise

    try:
        config = SweepConfig(sweeps=sweep_names(args.sweeps), trace_samples=args.trace_samples, seed=args.seed,
                             max_requests=args.max_requests, start_midstack=not args.no_skip,
                             atp_kinds=sweep_names(args.atp_kinds), verify_top=args.verify_top,
                             verify_random=args.verify_random, atp_correction=args.atp_correction,
                             head_positions=args.head_positions, **path_settings(args))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit} must be at least 1")
    if not Path(args.pairs).is_file():
        raise UsageError(f"--pairs {args.pairs}: no such file (make one with `patchgrid pairs check`)")
    pairs = accepted_pairs(read_pairs(args.pairs), args.limit)
    if not pairs:
        raise UsageError(f"--pairs {args.pairs}: holds no accepted pairs")
    noise_std = 0.0
    if "trace" in config.sweeps:
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


def atp_options(p) -> None:
    p.add_argument("--head-positions", default=DEFAULT_STUDY.head_positions, choices=HEAD_POSITIONS,
                   help="heads and neurons: every position at once plus the subject's last token and the last "
                        "token (roles), or each position one by one (every)")
    p.add_argument("--atp-kinds", default=",".join(DEFAULT_STUDY.atp_kinds),
                   help=f"atp sweep: the sweep kinds it screens, comma list of {', '.join(ATP_KINDS)}")
    p.add_argument("--verify-top", type=int, default=DEFAULT_STUDY.verify_top,
                   help="atp sweep: per pair and kind, patch the K sites with the largest estimates exactly")
    p.add_argument("--verify-random", type=int, default=DEFAULT_STUDY.verify_random,
                   help="atp sweep: and R sites sampled from the rest (seeded by --seed)")
    p.add_argument("--atp-correction", default=DEFAULT_STUDY.atp_correction, choices=ATP_CORRECTIONS,
                   help="atp sweep: rank sites by |estimate| (none) or by AtP*'s GradDrop score (graddrop)")


def path_options(p) -> None:
    p.add_argument("--path-senders", default=",".join(DEFAULT_STUDY.path_senders),
                   help="paths sweep: comma list of senders: heads, attn_out, mlp_out (every one) or head.L.H, "
                        "attn_out.L, mlp_out.L")
    p.add_argument("--path-receivers", default=",".join(DEFAULT_STUDY.path_receivers),
                   help="paths sweep: comma list of receivers: logits, heads (every head of a later layer) or head.L.H")
    p.add_argument("--path-inputs", default=",".join(DEFAULT_STUDY.path_inputs),
                   help="paths sweep: the receiver heads' inputs patched, comma list of q, k, v")
    p.add_argument("--path-mlps", default=DEFAULT_STUDY.path_mlps, choices=PATH_MLPS,
                   help="paths sweep: MLPs after the sender frozen (direct paths only) or recomputed (Wang et al.'s "
                        "freeze-and-patch: paths through MLPs count)")


def path_settings(args) -> dict:
    return dict(path_senders=sweep_names(args.path_senders), path_receivers=sweep_names(args.path_receivers),
                path_inputs=sweep_names(args.path_inputs), path_mlps=args.path_mlps)


def study_spec(args, **overrides) -> StudySpec:
    """The study the command line asks for, checked before anything runs."""
    source = Path(args.pairs)
    params = dict(model=args.model, pairs=str(source.resolve()) if source.exists() else args.pairs,
                  sweeps=args.sweeps, limit=args.limit, warehouse=args.warehouse, workdir=args.workdir,
                  pairs_format=args.format, require_known=not args.no_require_known,
                  answer_policy=args.answer_policy, seed=args.seed,
                  trace_samples=args.trace_samples, trace_noise=args.trace_noise, shard_size=args.shard_size,
                  backend=args.backend, skip=not args.no_skip,
                  runner=args.runner, ray_address=args.ray_address, ray_workers=args.ray_workers,
                  gpus_per_engine=args.gpus_per_engine, tensor_parallel_size=args.tensor_parallel_size,
                  atp_kinds=args.atp_kinds, verify_top=args.verify_top, verify_random=args.verify_random,
                  atp_correction=args.atp_correction, head_positions=args.head_positions, **path_settings(args))
    params.update(overrides)
    try:
        spec = StudySpec(**params)
        spec.check_inputs()
    except SpecError as exc:
        raise UsageError(exc.flag_message) from None
    from .models import prepare

    prepare(spec.model)  # a bad model name fails here, before Prefect starts
    return spec


def _run_study(spec: StudySpec, verbose: bool = False) -> str:
    from .flows.study import study
    from .progress import reporting_to

    if not verbose:
        one_line_failures()
    _migrate_prefect_database()
    with reporting_to(ProgressBar()):
        return study(**spec.flow_parameters())


def _migrate_prefect_database() -> None:
    """Bring the ephemeral Prefect server's database up to date, one process at a time. Two studies
    started at once with one PREFECT_HOME would otherwise both migrate a fresh database as their
    servers start, and alembic fails one of them; an up-to-date database migrates no further."""
    import fcntl

    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    if PREFECT_API_URL.value():  # a server of its own keeps its database
        return
    home = Path(PREFECT_HOME.value())
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".patchgrid-migrate.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        from prefect.server.database import provide_database_interface
        from prefect.utilities.asyncutils import run_coro_as_sync

        run_coro_as_sync(provide_database_interface().create_db())


def cmd_study(args) -> int:
    spec = study_spec(args)
    quiet_prefect(args.verbose)
    print(_run_study(spec, args.verbose))
    return 0


def cmd_demo_study(args) -> int:
    from .report import write_report
    from .warehouse.queries import every_metric, stream_by_layer, trace_by_bucket

    spec = StudySpec(model=args.model, sweeps=("resid", "attn_out", "mlp_out", "heads", "trace"), limit=args.limit,
                     warehouse=args.warehouse, trace_samples=args.trace_samples, backend=args.backend)
    quiet_prefect(False)
    run_id = _run_study(spec)
    print(f"\nrun {run_id} -> {args.warehouse}")
    print("\nresid patched clean into corrupt: recovery of the log-probability difference of the answers, scored "
          "whole (the logit difference for one-token answers), mean over pairs (effect_summary, every 4th layer):")
    print(format_rows(*stream_by_layer(args.warehouse, run_id, every=4)))
    print("\nthe same patch on every metric, at an early and a late layer (effect_summary; kl and logp_corrupt fall "
          "as the clean run comes back, rank has no recovery):")
    n_layers = _n_layers(args.model)
    print(format_rows(*every_metric(args.warehouse, run_id, (n_layers // 4, n_layers - 2))))
    print("\ncausal tracing, hidden state restored: average indirect effect on p(answer), in Meng et al.'s "
          "buckets (trace_buckets, every 4th layer):")
    print(format_rows(*trace_by_bucket(args.warehouse, run_id, every=4)))
    print(f"\nmore: patchgrid query --warehouse {args.warehouse} \"SELECT * FROM effect_summary LIMIT 20\"")
    page = write_report(args.warehouse, Path(args.warehouse).resolve().parent / "report", run_id)
    print(f"report: {page}")
    return 0


def _n_layers(model: str) -> int:
    from transformers import AutoConfig

    from .models import prepare
    from .sites import shape_of

    return shape_of(AutoConfig.from_pretrained(prepare(model), trust_remote_code=False)).n_layers


def cmd_report(args) -> int:
    from .report import write_report

    print(write_report(args.warehouse, args.out, args.run))
    return 0


def cmd_query(args) -> int:
    from .warehouse.loader import query

    print(format_rows(*query(args.warehouse, args.sql)))
    return 0


def cmd_serve(args) -> int:
    spec = study_spec(args)
    _check_cron(args.cron)
    quiet_prefect(True)
    from .serving import local_prefect_server

    # Prefect's ephemeral mode cannot schedule: without a server to talk to, start one on loopback,
    # before Prefect is imported here so that its settings see the server's address.
    with local_prefect_server(args.port):
        from .flows.study import study

        study.serve(name=args.name, cron=args.cron, parameters=spec.flow_parameters())
    return 0


def _check_cron(expr: str) -> None:
    from datetime import datetime

    from cronsim import CronSim, CronSimError  # what Prefect itself parses cron with

    try:
        CronSim(expr, datetime(2026, 1, 1))
    except CronSimError:
        raise UsageError(f"--cron {expr!r} is not a cron expression (five fields, e.g. \"0 3 * * *\")") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patchgrid", description="Activation-patching studies on vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="model folders")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="build a model folder if missing and print its path")
    prep.add_argument("name", help=f"{', '.join(BUILTIN)}, a folder or a hub id")
    prep.set_defaults(func=cmd_models_prepare)

    patch = sub.add_parser("patch", help="patch one clean/corrupt pair at every layer and position")
    patch.add_argument("--model", default=DEFAULT_MODEL)
    patch.add_argument("--clean", required=True)
    patch.add_argument("--corrupt", required=True)
    patch.add_argument("--clean-answer", required=True)
    patch.add_argument("--corrupt-answer", required=True)
    patch.add_argument("--site", required=True, choices=PATCHABLE)
    patch.add_argument("--position", default="all", help="a position, a comma list, or all (each separately)")
    patch.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS)
    patch.add_argument("--dtype", default="auto", choices=DTYPES)
    patch.add_argument("--top", type=int, default=None,
                       help="show only the N rows that move the metric most (neurons: 20 unless given)")
    patch.add_argument("--json", action="store_true", help="print the result as JSON")
    patch.set_defaults(func=cmd_patch)

    paths = sub.add_parser("paths", help="path patching on one clean/corrupt pair: senders to receivers")
    for name in ("--clean", "--corrupt", "--clean-answer", "--corrupt-answer"):
        paths.add_argument(name, required=True)
    paths.add_argument("--model", default=DEFAULT_MODEL)
    path_options(paths)
    paths.add_argument("--position", default="roles",
                       help="roles (every position at once, the subject's last token, the last token), a position, "
                            "a comma list, or all (each separately)")
    paths.add_argument("--top", type=int, default=20, help="the table shows the paths that move the metric most")
    paths.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS)
    paths.add_argument("--dtype", default="auto", choices=DTYPES)
    paths.add_argument("--json", action="store_true", help="print every path as JSON")
    paths.set_defaults(func=cmd_paths)

    pairs = sub.add_parser("pairs", help="prompt pairs")
    psub = pairs.add_subparsers(dest="pairs_command", required=True)
    check = psub.add_parser("check", help="pair and align a data set; print counts by status and reason")
    check.add_argument("--model", default=DEFAULT_MODEL)
    check.add_argument("--source", required=True, help="a .jsonl, .json or .parquet file, or a hub data-set name")
    check.add_argument("--format", default=None, choices=FORMATS, help="default: detected from the fields")
    check.add_argument("--require-known", action="store_true",
                       help="keep pairs whose clean log-probability difference (log p(clean answer) - "
                            "log p(corrupt answer), over every answer token) is positive and corrupt negative")
    check.add_argument("--answer-policy", default="full", choices=ANSWER_POLICIES, help=ANSWER_POLICY_HELP)
    check.add_argument("--seed", type=int, default=0, help="seed for drawing subject-swap partners")
    check.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS)
    check.add_argument("--out", default="pairs.parquet")
    check.set_defaults(func=cmd_pairs_check)

    sweep = sub.add_parser("sweep", help="cache clean activations and run sweeps over a pairs table")
    sweep.add_argument("--model", default=DEFAULT_MODEL)
    sweep.add_argument("--pairs", required=True, help="a pairs table written by `patchgrid pairs check`")
    sweep.add_argument("--sweeps", default=",".join(DEFAULT_SWEEPS), help=f"comma list of {', '.join(SWEEPS)}")
    sweep.add_argument("--limit", type=int, default=None, help="the first N accepted pairs")
    sweep.add_argument("--trace-samples", type=int, default=10)
    sweep.add_argument("--seed", type=int, default=0)
    sweep.add_argument("--max-requests", type=int, default=2048, help="patched runs per engine call")
    sweep.add_argument("--cache", default=".patchgrid-cache", help="activation cache folder")
    sweep.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS)
    sweep.add_argument("--no-skip", action="store_true", help=NO_SKIP_HELP)
    atp_options(sweep)
    path_options(sweep)
    sweep.add_argument("--out", default="effects.parquet")
    sweep.set_defaults(func=cmd_sweep)

    def study_options(p):
        p.add_argument("--model", default=DEFAULT_MODEL)
        p.add_argument("--pairs", required=True, help="a data set: .jsonl, .json, .parquet or a hub name")
        p.add_argument("--sweeps", default=",".join(DEFAULT_SWEEPS), help=f"comma list of {', '.join(SWEEPS)}")
        p.add_argument("--limit", type=int, default=None, help="the first N accepted pairs")
        p.add_argument("--warehouse", default=DEFAULT_STUDY.warehouse)
        p.add_argument("--workdir", default=DEFAULT_STUDY.workdir, help="pairs tables, effect shards, activation cache")
        p.add_argument("--format", default=None, choices=FORMATS)
        p.add_argument("--no-require-known", action="store_true", help="keep pairs the model does not know")
        p.add_argument("--answer-policy", default=DEFAULT_STUDY.answer_policy, choices=ANSWER_POLICIES,
                       help=ANSWER_POLICY_HELP)
        p.add_argument("--seed", type=int, default=DEFAULT_STUDY.seed)
        p.add_argument("--trace-samples", type=int, default=DEFAULT_STUDY.trace_samples)
        p.add_argument("--trace-noise", type=float, default=DEFAULT_STUDY.trace_noise,
                       help="std of causal tracing's noise (default: 3 x std of the data set's subject embeddings)")
        p.add_argument("--shard-size", type=int, default=DEFAULT_STUDY.shard_size, help="pairs per sweep task")
        p.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS)
        p.add_argument("--no-skip", action="store_true", help=NO_SKIP_HELP)
        p.add_argument("--runner", default=DEFAULT_STUDY.runner, choices=RUNNERS,
                       help="local: shards one after another in this process; ray: shards as Ray tasks")
        p.add_argument("--ray-address", default=None, help="a Ray cluster (default: a local Ray the flow starts)")
        p.add_argument("--ray-workers", type=int, default=DEFAULT_STUDY.ray_workers,
                       help="engine actors, each one vLLM engine")
        p.add_argument("--gpus-per-engine", type=float, default=DEFAULT_STUDY.gpus_per_engine)
        p.add_argument("--tensor-parallel-size", type=int, default=DEFAULT_STUDY.tensor_parallel_size,
                       help="ranks per engine (Ray runner)")
        atp_options(p)
        path_options(p)
        p.add_argument("--verbose", action="store_true", help="Prefect's run log on the console")

    st = sub.add_parser("study", help="a whole study: data set -> pairs -> cache -> sweeps -> warehouse")
    study_options(st)
    st.set_defaults(func=cmd_study)

    srv = sub.add_parser("serve", help="serve the study flow on a cron schedule from this process")
    study_options(srv)
    srv.add_argument("--cron", required=True, help='e.g. "0 3 * * *"')
    srv.add_argument("--name", default="patchgrid-study")
    srv.add_argument("--port", type=int, default=4200, help="for the local Prefect server, when PREFECT_API_URL is unset")
    srv.set_defaults(func=cmd_serve)

    rep = sub.add_parser("report", help="an HTML page and PNGs of a study's heatmaps, from the warehouse's views")
    rep.add_argument("--warehouse", default=DEFAULT_STUDY.warehouse)
    rep.add_argument("--run", default=None, help="a run id (default: the latest run)")
    rep.add_argument("--out", required=True, help="folder for report.html and the PNGs")
    rep.set_defaults(func=cmd_report)

    q = sub.add_parser("query", help="run SQL on the warehouse, read-only")
    q.add_argument("--warehouse", default=DEFAULT_STUDY.warehouse)
    q.add_argument("sql")
    q.set_defaults(func=cmd_query)

    demo = sub.add_parser("demo", help="the France/Germany example, then a study of the shipped pairs")
    demo.add_argument("--model", default=DEFAULT_MODEL)
    demo.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS)
    demo.add_argument("--limit", type=int, default=20, help="accepted pairs in the demo study")
    demo.add_argument("--trace-samples", type=int, default=3)
    demo.add_argument("--warehouse", default=DEFAULT_STUDY.warehouse)
    demo.add_argument("--quick", action="store_true", help="only the France/Germany sweep")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    quiet_engine_logs()
    from .stopping import Cancelled, cancel_on_signals, one_line, signalled

    try:
        with cancel_on_signals():
            try:
                return args.func(args)
            except Exception:
                if signalled():  # the signal's exception was replaced on its way out
                    raise Cancelled(signalled()) from None
                raise
    # ModelError, PairError, PlanError, SourceError, SpecError, RowError and WarehouseError are
    # ValueErrors: each names what is wrong in the user's input.
    except (UsageError, ValueError, OSError) as exc:
        text = " ".join(str(exc).split())  # one line, whatever the library wrote
        print(f"patchgrid: error: {text}", file=sys.stderr)
        return 2
    except (Cancelled, KeyboardInterrupt) as exc:
        signame = exc.signame if isinstance(exc, Cancelled) else "SIGINT"
        print(f"patchgrid: stopped by {signame}; a running study is recorded as cancelled", file=sys.stderr)
        return 128 + int(getattr(signal, signame))
    except Exception as exc:
        if getattr(args, "verbose", False):
            raise
        print(f"patchgrid: error: {' '.join(one_line(exc).split())} (--verbose shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
