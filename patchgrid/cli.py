"""The `patchgrid` command line. Input is validated here; the library takes plain values."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .rows import ANSWER_POLICIES
from .pairs.sources import FORMATS
from .sites import SITE_KINDS

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


def _quiet_vllm():
    # vLLM logs every engine setting at INFO; a researcher at the terminal wants the table.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # stdout carries tables and JSON; vLLM's log lines go to stderr.
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _tokenizer(model: str):
    _quiet_vllm()
    from transformers import AutoTokenizer

    from .models import prepare

    return AutoTokenizer.from_pretrained(prepare(model), trust_remote_code=False)


def _engine(model: str, backend: str, dtype: str):
    from .engine import load_engine

    return load_engine(model, backend, dtype=dtype)


def cmd_models_prepare(args) -> int:
    from .models import prepare

    print(prepare(args.name))
    return 0


def cmd_patch(args) -> int:
    from .patching import sweep_pair, tokenize_pair

    positions = _positions(args.position)
    # Everything about the pair is checked before an engine starts.
    pair = tokenize_pair(_tokenizer(args.model), args.clean, args.corrupt, args.clean_answer, args.corrupt_answer)
    for p in positions or ():
        if not 0 <= p < len(pair.clean):
            raise UsageError(f"--position {p} is out of range (the prompts have {len(pair.clean)} tokens)")
    engine = _engine(args.model, args.backend, args.dtype)
    try:
        out = sweep_pair(engine, pair, args.site, positions)
    finally:
        engine.close()
    if args.json:
        print(json.dumps(out))
    else:
        print(format_table(out, pair.clean_strs))
    return 0


def cmd_demo(args) -> int:
    from .patching import recovery, sweep_pair, tokenize_pair

    pair = tokenize_pair(_tokenizer(args.model), **DEMO)
    engine = _engine(args.model, args.backend, "auto")
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
        print(f"{layer:>5}  {recovery(by[layer, subject], base):>18.2f}  {recovery(by[layer, last], base):>14.2f}")
    if args.quick:
        return 0
    print()
    return cmd_demo_study(args)


def cmd_pairs_check(args) -> int:
    from .pairs import build_pairs, read_source, summary, write_pairs

    tokenizer = _tokenizer(args.model)
    fmt, records = read_source(args.source, args.format)
    from transformers import AutoConfig

    from .models import prepare
    from .sites import shape_of

    max_len = shape_of(AutoConfig.from_pretrained(prepare(args.model))).max_len
    engine = _engine(args.model, args.backend, "auto") if args.require_known else None
    try:
        rows = build_pairs(records, tokenizer, max_len=max_len, seed=args.seed, answer_policy=args.answer_policy,
                           engine=engine, require_known=args.require_known)
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
    from pathlib import Path

    from .cache import load_or_build
    from .effects import write_effects
    from .pairs import accepted_pairs, read_pairs
    from .sweeps import SweepConfig, cache_spec, run_sweeps

    config = SweepConfig(sweeps=_names(args.sweeps, "--sweeps"), trace_samples=args.trace_samples,
                         seed=args.seed, max_requests=args.max_requests)
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit} must be at least 1")
    if not Path(args.pairs).is_file():
        raise UsageError(f"--pairs {args.pairs}: no such file (make one with `patchgrid pairs check`)")
    pairs = accepted_pairs(read_pairs(args.pairs), args.limit)
    if not pairs:
        raise UsageError(f"--pairs {args.pairs}: holds no accepted pairs")
    _quiet_vllm()
    engine = _engine(args.model, args.backend, "auto")
    try:
        log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
        cache, built = load_or_build(engine, pairs, cache_spec(config, engine.shape.n_layers), Path(args.cache),
                                     log=log)
        print(f"cache {'built' if built else 'found'}: {cache.folder} ({cache.bytes_per_pair / 1e3:.1f} kB per pair)")
        rows = run_sweeps(engine, pairs, cache, config,
                          progress=lambda done, total: print(f"\r{done}/{total} patched runs", end="",
                                                             file=sys.stderr))
        print(file=sys.stderr)
    finally:
        engine.close()
    write_effects(rows, args.out)
    print(f"{len(pairs)} pairs, {len(rows)} effect rows -> {args.out}")
    return 0


def _names(text: str, flag: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise UsageError(f"{flag} is empty")
    return names


def _prefect_env(verbose: bool = False):
    # Ephemeral Prefect: no server to run; its telemetry cannot reach out from these machines.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    _quiet_vllm()


class ProgressBar:
    """Patched runs done in the current shard, on one refreshing line of stderr."""

    def __init__(self):
        self.shard, self.last = 0, None

    def __call__(self, done: int, total: int):
        if self.last is None or done < self.last:
            self.shard += 1
        self.last = done
        width = 30
        filled = int(width * done / max(total, 1))
        # sys.stderr.write, not print: the flow's log_prints would turn a print into a log record
        sys.stderr.write(f"\rshard {self.shard} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} patched runs"
                         + ("" if done < total else "\n"))
        sys.stderr.flush()


def _run_study(**params) -> str:
    from .flows.study import study
    from .tasks.sweeps import PROGRESS_HOOKS

    bar = ProgressBar()
    PROGRESS_HOOKS.append(bar)
    try:
        return study(**params)
    finally:
        PROGRESS_HOOKS.remove(bar)


def _study_params(args) -> dict:
    from pathlib import Path

    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit} must be at least 1")
    if args.shard_size < 1:
        raise UsageError(f"--shard-size {args.shard_size} must be at least 1")
    if args.trace_samples < 1:
        raise UsageError(f"--trace-samples {args.trace_samples} must be at least 1")
    source = Path(args.pairs)
    if not source.exists() and not (args.pairs.count("/") == 1 and not args.pairs.startswith((".", "/", "~"))):
        raise UsageError(f"--pairs {args.pairs}: no such file (nor a hub data-set name owner/name)")
    wh = Path(args.warehouse)
    if wh.parent != Path("") and not wh.parent.is_dir():
        raise UsageError(f"--warehouse {args.warehouse}: folder {wh.parent} does not exist")
    from .warehouse.loader import check_writable

    check_writable(wh)
    from .sweeps import SweepConfig

    SweepConfig(sweeps=_names(args.sweeps, "--sweeps"))
    if args.runner == "ray":
        try:
            import prefect_ray  # noqa: F401
            import ray  # noqa: F401
        except ImportError:
            raise UsageError("--runner ray needs ray and prefect-ray (pip install 'patchgrid[ray]')") from None
    elif args.ray_address:
        raise UsageError("--ray-address needs --runner ray")
    if args.ray_workers < 1:
        raise UsageError(f"--ray-workers {args.ray_workers} must be at least 1")
    if args.gpus_per_engine < 0:
        raise UsageError(f"--gpus-per-engine {args.gpus_per_engine} must not be negative")
    if args.tensor_parallel_size < 1:
        raise UsageError(f"--tensor-parallel-size {args.tensor_parallel_size} must be at least 1")
    ray = dict(runner=args.runner, ray_address=args.ray_address, ray_workers=args.ray_workers,
               gpus_per_engine=args.gpus_per_engine, tensor_parallel_size=args.tensor_parallel_size)
    return dict(**ray, model=args.model, pairs=str(source.resolve()) if source.exists() else args.pairs,
                sweeps=args.sweeps, limit=args.limit, warehouse=str(wh), workdir=args.workdir,
                pairs_format=args.format, require_known=not args.no_require_known, seed=args.seed,
                trace_samples=args.trace_samples, shard_size=args.shard_size, backend=args.backend)


def cmd_study(args) -> int:
    params = _study_params(args)
    from .models import prepare

    prepare(args.model)  # a bad model name fails here, before Prefect starts
    _prefect_env(args.verbose)
    run_id = _run_study(**params)
    print(run_id)
    return 0


def cmd_demo_study(args) -> int:
    from .flows.study import SHIPPED_PAIRS
    from .warehouse.loader import query

    _prefect_env(False)
    run_id = _run_study(model=args.model, pairs=SHIPPED_PAIRS, sweeps="resid,attn_out,mlp_out,heads,trace",
                        limit=args.limit, warehouse=args.warehouse, trace_samples=args.trace_samples,
                        backend=args.backend)
    cols, rows = query(args.warehouse, """
        SELECT sweep, site, direction, layer, position_role, head, n_pairs, round(mean_recovery, 3) AS mean_recovery,
               round(ci95_low, 3) AS ci95_low, round(ci95_high, 3) AS ci95_high
        FROM effect_summary WHERE run_id = ? AND sweep IN ('resid', 'trace') AND site = 'resid'
          AND direction = 'denoise' AND position_role IN ('subject_last', 'last') AND layer % 4 = 0
        ORDER BY sweep, position_role DESC, layer""", [run_id])
    print(f"\nrun {run_id} -> {args.warehouse}; effect_summary (resid and trace hidden state, every 4th layer):")
    print(format_rows(cols, rows))
    print(f"\nmore: patchgrid query --warehouse {args.warehouse} \"SELECT * FROM effect_summary LIMIT 20\"")
    from pathlib import Path

    from .report import write_report

    page = write_report(args.warehouse, Path(args.warehouse).resolve().parent / "report", run_id)
    print(f"report: {page}")
    return 0


def cmd_report(args) -> int:
    from .report import write_report

    page = write_report(args.warehouse, args.out, args.run)
    print(page)
    return 0


def cmd_query(args) -> int:
    from .warehouse.loader import query

    cols, rows = query(args.warehouse, args.sql)
    print(format_rows(cols, rows))
    return 0


def cmd_serve(args) -> int:
    params = _study_params(args)
    _check_cron(args.cron)
    _prefect_env(True)
    from .serving import local_prefect_server

    # Prefect's ephemeral mode cannot schedule: without a server to talk to, start one on loopback,
    # before Prefect is imported here so that its settings see the server's address.
    with local_prefect_server(args.port):
        from .flows.study import study

        study.serve(name=args.name, cron=args.cron, parameters=params)
    return 0


def _check_cron(expr: str) -> None:
    from datetime import datetime

    from cronsim import CronSim, CronSimError  # what Prefect itself parses cron with

    try:
        CronSim(expr, datetime(2026, 1, 1))
    except CronSimError:
        raise UsageError(f"--cron {expr!r} is not a cron expression (five fields, e.g. \"0 3 * * *\")") from None


def format_rows(cols, rows) -> str:
    def cell(v):
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    lines.append(f"({len(rows)} rows)")
    return "\n".join(lines)


def format_table(out: dict, token_strs) -> str:
    effects = out["effects"]
    base = out["baseline"]
    positions = sorted({e["position"] for e in effects})
    lines = [f"baseline logit difference: clean {base['clean']:+.3f}, corrupt {base['corrupt']:+.3f}",
             "patched logit difference by layer (rows) and position (columns):"]
    head_site = effects and effects[0]["head"] is not None
    label = "layer.head" if head_site else "layer"
    cols = [f"{p}:{token_strs[p]!r}" if p < len(token_strs) else str(p) for p in positions]
    width = max(10, *(len(c) for c in cols))
    lines.append(f"{label:>10} " + " ".join(f"{c:>{width}}" for c in cols))
    rows = {}
    for e in effects:
        rows.setdefault((e["layer"], e["head"]), {})[e["position"]] = e["logit_diff"]
    for (layer, head), vals in rows.items():
        name = "embed" if layer is None else (f"{layer}.{head}" if head is not None else str(layer))
        lines.append(f"{name:>10} " + " ".join(f"{vals[p]:>{width}.3f}" for p in positions))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patchgrid", description="Activation-patching studies on vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="model folders")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="build a model folder if missing and print its path")
    prep.add_argument("name", help="smollm2-135m, tiny-llama, tiny-qwen3, tiny-gpt2, a folder or a hub id")
    prep.set_defaults(func=cmd_models_prepare)

    patch = sub.add_parser("patch", help="patch one clean/corrupt pair at every layer and position")
    patch.add_argument("--model", default="smollm2-135m")
    patch.add_argument("--clean", required=True)
    patch.add_argument("--corrupt", required=True)
    patch.add_argument("--clean-answer", required=True)
    patch.add_argument("--corrupt-answer", required=True)
    patch.add_argument("--site", required=True, choices=SITE_KINDS)
    patch.add_argument("--position", default="all", help="a position, a comma list, or all (each separately)")
    patch.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
    patch.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    patch.add_argument("--json", action="store_true", help="print the result as JSON")
    patch.set_defaults(func=cmd_patch)

    pairs = sub.add_parser("pairs", help="prompt pairs")
    psub = pairs.add_subparsers(dest="pairs_command", required=True)
    check = psub.add_parser("check", help="pair and align a data set; print counts by status and reason")
    check.add_argument("--model", default="smollm2-135m")
    check.add_argument("--source", required=True, help="a .jsonl, .json or .parquet file, or a hub data-set name")
    check.add_argument("--format", default=None, choices=FORMATS, help="default: detected from the fields")
    check.add_argument("--require-known", action="store_true",
                       help="keep pairs whose clean logit difference is positive and corrupt negative")
    check.add_argument("--answer-policy", default="single", choices=ANSWER_POLICIES,
                       help="single: reject multi-token answers; first-token: keep their first token (recorded)")
    check.add_argument("--seed", type=int, default=0, help="seed for drawing subject-swap partners")
    check.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
    check.add_argument("--out", default="pairs.parquet")
    check.set_defaults(func=cmd_pairs_check)

    sweep = sub.add_parser("sweep", help="cache clean activations and run sweeps over a pairs table")
    sweep.add_argument("--model", default="smollm2-135m")
    sweep.add_argument("--pairs", required=True, help="a pairs table written by `patchgrid pairs check`")
    sweep.add_argument("--sweeps", default="resid,attn_out,mlp_out,heads",
                       help="comma list of resid, attn_out, mlp_out, heads, trace")
    sweep.add_argument("--limit", type=int, default=None, help="the first N accepted pairs")
    sweep.add_argument("--trace-samples", type=int, default=10)
    sweep.add_argument("--seed", type=int, default=0)
    sweep.add_argument("--max-requests", type=int, default=2048, help="patched runs per engine call")
    sweep.add_argument("--cache", default=".patchgrid-cache", help="activation cache folder")
    sweep.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
    sweep.add_argument("--out", default="effects.parquet")
    sweep.set_defaults(func=cmd_sweep)

    def study_options(p):
        p.add_argument("--model", default="smollm2-135m")
        p.add_argument("--pairs", required=True, help="a data set: .jsonl, .json, .parquet or a hub name")
        p.add_argument("--sweeps", default="resid,attn_out,mlp_out,heads",
                       help="comma list of resid, attn_out, mlp_out, heads, trace")
        p.add_argument("--limit", type=int, default=None, help="the first N accepted pairs")
        p.add_argument("--warehouse", default="warehouse.duckdb")
        p.add_argument("--workdir", default=".patchgrid", help="pairs tables, effect shards, activation cache")
        p.add_argument("--format", default=None, choices=FORMATS)
        p.add_argument("--no-require-known", action="store_true", help="keep pairs the model does not know")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--trace-samples", type=int, default=10)
        p.add_argument("--shard-size", type=int, default=8, help="pairs per sweep task")
        p.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
        p.add_argument("--runner", default="local", choices=("local", "ray"),
                       help="local: shards one after another in this process; ray: shards as Ray tasks")
        p.add_argument("--ray-address", default=None, help="a Ray cluster (default: a local Ray the flow starts)")
        p.add_argument("--ray-workers", type=int, default=2, help="engine actors, each one vLLM engine")
        p.add_argument("--gpus-per-engine", type=float, default=0.0)
        p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks per engine (Ray runner)")
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
    rep.add_argument("--warehouse", default="warehouse.duckdb")
    rep.add_argument("--run", default=None, help="a run id (default: the latest run)")
    rep.add_argument("--out", required=True, help="folder for report.html and the PNGs")
    rep.set_defaults(func=cmd_report)

    q = sub.add_parser("query", help="run SQL on the warehouse, read-only")
    q.add_argument("--warehouse", default="warehouse.duckdb")
    q.add_argument("sql")
    q.set_defaults(func=cmd_query)

    demo = sub.add_parser("demo", help="the France/Germany example, then a study of the shipped pairs")
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--backend", default="vllm", choices=("vllm", "hf"))
    demo.add_argument("--limit", type=int, default=20, help="accepted pairs in the demo study")
    demo.add_argument("--trace-samples", type=int, default=3)
    demo.add_argument("--warehouse", default="warehouse.duckdb")
    demo.add_argument("--quick", action="store_true", help="only the France/Germany sweep")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv=None) -> int:
    from .models import ModelError
    from .pairs import SourceError
    from .patching import PairError
    from .plan import PlanError
    from .warehouse.loader import WarehouseError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ModelError, PairError, PlanError, SourceError, WarehouseError, ValueError, OSError) as exc:
        text = " ".join(str(exc).split())  # one line, whatever the library wrote
        print(f"patchgrid: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
