"""Commands that run the study flow: study, serve, and the demo's study."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ..pipeline.spec import SpecError, StudySpec
from ..runtime.console import ProgressBars, format_rows, one_line_failures, quiet_prefect
from ..sweeps import SweepConfig
from .common import UsageError
from .options import settings_from

DEMO_SWEEPS = ("resid", "attn_out", "mlp_out", "heads", "trace")
DEPLOYMENT = "patchgrid-study"  # serve's deployment, unless --name names it
TAKES_A_STUDY_FILE = "takes_a_study_file"  # the parser default that marks a command taking --config


class CommandParser(argparse.ArgumentParser):
    """A command's parser. One that takes a study file (add_config_option: study, serve) reads it
    first: the file's settings become the command's defaults, the flags given override them, and
    the file's text is the `config` setting (recorded with the run). A flag is taken only written whole:
    argparse's abbreviations would read `--sweep` as `--sweeps` without a word."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if self.get_default(TAKES_A_STUDY_FILE):
            self._read_study_file(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)

    def _read_study_file(self, args: list[str]) -> None:
        from ..pipeline.studyfile import StudyFileError, read_study_file

        first = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
        first.add_argument("--config", dest="config_file")
        try:
            path = first.parse_known_args(args)[0].config_file
        except argparse.ArgumentError:
            return  # --config without a file: the command's own parse says so
        if path is None:
            return
        try:
            settings, text = read_study_file(path)
        except StudyFileError as exc:
            self.exit(2, f"patchgrid: error: {' '.join(str(exc).split())}\n")
        self.set_defaults(**settings, config=text)


def add_config_option(p) -> None:
    """--config FILE: a study file (patchgrid.pipeline.studyfile), read before the rest (CommandParser)."""
    p.add_argument("--config", dest="config_file", metavar="FILE", default=None,
                   help="a study file (TOML): settings by name (e.g. limit = 2, sweeps = \"resid,heads\"), the "
                        "defaults of this command; flags given override them; its content is recorded with the run")
    p.set_defaults(**{TAKES_A_STUDY_FILE: True})


def study_spec(args, **overrides) -> StudySpec:
    """The study the command line asks for, checked before anything runs."""
    params = {**settings_from(args, StudySpec), **settings_from(args, SweepConfig)}
    source = Path(params["pairs"])
    if source.exists():
        params["pairs"] = str(source.resolve())
    params.update(overrides)
    try:
        spec = StudySpec.of(**params)
        spec.check_inputs()
    except SpecError as exc:
        raise UsageError(exc.flag_message) from None
    from ..model.models import prepare
    from ..sweeps.base import check_layers

    prepare(spec.model)  # a bad model name fails here, before Prefect starts
    if spec.sweep.layers is not None:  # so does a layer the model does not have
        try:
            check_layers(spec.sweep, _n_layers(spec.model), spec.model)
        except SpecError as exc:
            raise UsageError(exc.flag_message) from None
    return spec


def _run_study(spec: StudySpec, verbose: bool = False) -> str:
    from ..flows.study import study
    from ..runtime.progress import reporting_to

    if not verbose:
        one_line_failures()
    _migrate_prefect_database()
    with ProgressBars() as bars, reporting_to(bars):  # progress on stderr, one bar per stage
        return study(spec)


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
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the summary (or the run id, or JSON) alone
        run_id = _run_study(spec, args.verbose)
    if args.quiet:
        print(run_id)
        return 0
    from ..pipeline.summary import study_summary

    summary = study_summary(spec.warehouse, run_id)  # read back from the warehouse, read-only
    print(json.dumps(summary, default=str) if args.json else format_summary(summary))
    return 0


def edge_lines(edges: list[dict]) -> list[str]:
    """The strongest edges, where the run scored edges."""
    if not edges:
        return []
    return [f"\nstrongest edges ({edges[0]['method']} scores, edge_summary, on {edges[0]['metric']}; mean score "
            "over pairs, 95% t interval; estimates, not patched runs):",
            format_rows(["sender", "receiver", "position_role", "n_pairs", "mean_score", "ci95_low", "ci95_high"],
                        [(e["sender"], e["receiver"], e["position_role"], e["n_pairs"], e["mean_score"],
                          e["score_ci95_low"], e["score_ci95_high"]) for e in edges])]


def circuit_lines(circuits: list[dict]) -> list[str]:
    """The circuits' figures, where the run judged circuits."""
    if not circuits:
        return []
    first = circuits[0]
    return [f"\ncircuits (circuit_score, MIB's figures over {first['n_sizes']} sizes, on {first['metric']}, "
            f"{first['n_pairs']} pairs; CPR higher and CMD lower are better):",
            format_rows(["method", "build", "ablation", "cpr", "cmd", "faithfulness_10%"],
                        [(c["method"], c["build"], c["ablation"], c["cpr"], c["cmd"], c["faithfulness_10"])
                         for c in circuits])]


def knockout_lines(knockouts: list[dict]) -> list[str]:
    """Where blocking the last position's attention lowered p(answer) most, per group, where the run knocked out."""
    if not knockouts:
        return []
    return ["\nattention knockout (knockout_curve: the last position blocked from each group over a window of "
            "layers; relative change of p(answer) in %, mean over facts, 95% t interval; the layer where it falls "
            "most):",
            format_rows(["blocked", "layer", "window", "n_pairs", "change_pct", "ci95_low", "ci95_high"],
                        [(k["blocked"], k["layer"], k["window"], k["n_pairs"], k["mean_relative_change_pct"],
                          k["relative_change_ci95_low"], k["relative_change_ci95_high"]) for k in knockouts])]


def format_summary(s: dict) -> str:
    """The summary as the terminal shows it; its last line is the run id alone, as --quiet prints it."""
    rec = s["records"]
    reasons = ", ".join(f"{reason} {n}" for reason, n in rec["rejected_by_reason"].items())
    took = "" if s["seconds"] is None else f" in {s['seconds']:.1f} s"
    named = f" ({s['name']})" if s.get("name") else ""
    lines = [f"run {s['run_id']}{named} {s['status']}{took}: model {s['model']}, warehouse {s['warehouse']}",
             f"records: {rec['read']} read, {rec['accepted']} accepted, {rec['rejected']} rejected"
             + (f" ({reasons})" if reasons else "")
             + (f", {rec['not_judged']} not judged (the limit was reached before them)" if rec["not_judged"] else ""),
             "\nsweeps (effect rows: one per patched run, or per estimate for atp and edges):",
             format_rows(["sweep", "pairs", "effect_rows", "patched_runs"],
                         [(w["sweep"], w["pairs"], w["effect_rows"], w["patched_runs"]) for w in s["sweeps"]]),
             "\nstrongest averaged cells per sweep and direction (effect_summary, on the sweep's metric; 95% t "
             "interval): denoising ranked by mean recovery (1: the patch restores the clean run), noising by 1 - "
             "mean recovery (0: the patch changes nothing); a cell without a recovery by its mean effect toward "
             "the clean run's value (denoising) or away from it (noising)",
             format_rows(["sweep", "cell", "metric", "n_pairs", "mean_of", "mean", "ci95_low", "ci95_high"],
                         [(c["sweep"], c["cell"], c["metric"], c["n_pairs"], c["mean_of"], c["mean"], c["ci95_low"],
                           c["ci95_high"]) for c in s["strongest"]]),
             *edge_lines(s.get("strongest_edges") or []),
             *circuit_lines(s.get("circuits") or []),
             *knockout_lines(s.get("knockouts") or []),
             f"\nquery:  {s['commands']['query']}",
             f"report: {s['commands']['report']}",
             s["run_id"]]
    return "\n".join(lines)


def cmd_demo_study(args) -> int:
    from ..report import write_report
    from ..warehouse.queries import every_metric, stream_by_layer, trace_by_bucket

    spec = StudySpec.of(model=args.model, sweeps=DEMO_SWEEPS, limit=args.limit, warehouse=args.warehouse,
                        trace_samples=args.trace_samples, backend=args.backend)
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

    from ..model.models import prepare
    from ..model.sites import shape_of

    return shape_of(AutoConfig.from_pretrained(prepare(model), trust_remote_code=False)).n_layers


def cmd_serve(args) -> int:
    spec = study_spec(args)
    _check_cron(args.cron)
    if args.concurrency_limit < 1:
        raise UsageError(f"--concurrency-limit {args.concurrency_limit}: at least 1 run must be allowed at once")
    quiet_prefect(True)
    from ..runtime.serving import concurrency_limit, local_prefect_server, overlap_line, serve

    # Prefect's ephemeral mode cannot schedule: without a server to talk to, start one on loopback,
    # before Prefect is imported here so that its settings see the server's address.
    with local_prefect_server(args.port):
        from ..flows.study import study

        print(overlap_line(args.concurrency_limit, args.on_overlap), file=sys.stderr)
        # until the first SIGINT or SIGTERM, which stops the runs in flight too
        serve(study, name=spec.name or DEPLOYMENT, cron=args.cron, parameters={"spec": spec},
              concurrency_limit=concurrency_limit(args.concurrency_limit, args.on_overlap))
    return 0


def _check_cron(expr: str) -> None:
    from datetime import datetime

    from cronsim import CronSim, CronSimError  # what Prefect itself parses cron with

    try:
        CronSim(expr, datetime(2026, 1, 1))
    except CronSimError:
        raise UsageError(f"--cron {expr!r} is not a cron expression (five fields, e.g. \"0 3 * * *\")") from None


