"""The command line's parser: every command, its options generated from the settings' declarations
where a setting has one (options.add_settings), and the command's own options beside them."""
from __future__ import annotations

import argparse

from ..metrics import METRICS
from ..model.models import BUILTIN
from ..model.sites import PATCHABLE
from ..pipeline.spec import StudySpec
from ..rows.shapes import SWEEP_NAMES
from ..runtime.serving import DEFAULT_CONCURRENCY_LIMIT, DEFAULT_ON_OVERLAP, ON_OVERLAP
from ..sweeps import SweepConfig
from ..warehouse.compare import MEASURES as COMPARED
from . import attention, dashboard, data, pair, study, warehouse
from .options import HelpFormatter, add_settings

DEFAULT_STUDY = StudySpec()
# The settings that describe one pair's engine, shared by the one-pair commands
ENGINE_SETTINGS = ("model", "backend", "dtype")
PAIR = ("--clean", "--corrupt", "--clean-answer", "--corrupt-answer")
PAIR_HELP = {"--clean": "the clean prompt", "--corrupt": "the corrupt prompt, as many tokens as the clean one",
             "--clean-answer": "the clean prompt's answer, tokenised as a data set's is: after a space when the "
                               "prompt does not end in one",
             "--corrupt-answer": "the corrupt prompt's answer, tokenised the same way"}
VERBOSE = "a failure's traceback on the console"


def _leaf(sub, name: str, func, help: str, verbose: str = VERBOSE) -> argparse.ArgumentParser:
    """A command: its parser, which shows every default in --help and takes --verbose (main reads it)."""
    p = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
    p.set_defaults(func=func)
    p.add_argument("--verbose", action="store_true", help=verbose)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patchgrid", description="Activation-patching studies on vLLM.",
                                     formatter_class=HelpFormatter, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=study.CommandParser)

    def command(name, func, help, verbose=VERBOSE):
        return _leaf(sub, name, func, help, verbose)

    _models(sub)
    _patch(command("patch", pair.cmd_patch, "patch one clean/corrupt pair at every layer and position"))
    _paths(command("paths", pair.cmd_paths, "path patching on one clean/corrupt pair: senders to receivers"))
    _attention(command("attention", attention.cmd_attention, "one text's attention patterns, per layer and head"))
    _pairs(sub)
    _sweep(command("sweep", data.cmd_sweep, "a pairs table -> cache -> sweeps -> effects file and warehouse"))
    _study(command("study", study.cmd_study, "a whole study: data set -> pairs -> cache -> sweeps -> warehouse",
                   verbose="Prefect's run log on the console, and a failure's traceback"), summary=True)
    srv = command("serve", study.cmd_serve, "serve the study flow on a cron schedule from this process")
    _study(srv)
    srv.add_argument("--cron", required=True, help='e.g. "0 3 * * *"')
    srv.add_argument("--port", type=int, default=4200,
                     help="for the local Prefect server, when PREFECT_API_URL is unset")
    srv.add_argument("--concurrency-limit", type=int, default=DEFAULT_CONCURRENCY_LIMIT, metavar="N",
                     help="at most N runs of the deployment at once (N >= 1)")
    srv.add_argument("--on-overlap", choices=tuple(ON_OVERLAP), default=DEFAULT_ON_OVERLAP,
                     help="a run due while N are running: wait for one to end, or skip it (cancelled)")
    rep = command("report", warehouse.cmd_report,
                  "an HTML page of a run's figures, each also as PNG, SVG and PDF, from the warehouse")
    add_settings(rep, StudySpec, only=("warehouse",))
    rep.add_argument("--run", default=None,
                     help="a run id (default: the latest completed run); a run that failed, was cancelled or is "
                          "still running is reported with its status, the reason it ended and what it loaded")
    rep.add_argument("--out", required=True, help="folder for report.html and each figure's PNG, SVG and PDF")
    rep.add_argument("--circuit-size", type=float, default=None, metavar="PERCENT",
                     help="the circuit drawn as a diagram, by its size in percent of the edges (default: the "
                          "smallest whose faithfulness reaches 0.8, else the one nearest 5%%)")
    dash = command("dashboard", dashboard.cmd_dashboard,
                   "a live dashboard of the warehouse in the browser (Streamlit), read-only")
    add_settings(dash, StudySpec, only=("warehouse",))
    dash.add_argument("--address", default="127.0.0.1",
                      help="the address the page is served on (0.0.0.0: every interface, for other machines)")
    dash.add_argument("--port", type=int, default=8501, help="the port the page is served on")
    dash.add_argument("--refresh", type=float, default=2.0, metavar="S", help="seconds between reads of the runs")
    q = command("query", warehouse.cmd_query, "run SQL on the warehouse, read-only")
    add_settings(q, StudySpec, only=("warehouse",))
    q.add_argument("sql", help="the query: SQL on the warehouse's views")
    _result_options(q)
    _compare(command("compare", warehouse.cmd_compare, "two runs' averaged cells side by side: both means, "
                     "the difference B - A and its 95 percent t interval"))
    _demo(command("demo", pair.cmd_demo, "the France/Germany example, then a study of the shipped pairs"))
    return parser


def _result_options(p) -> None:
    p.add_argument("--format", choices=warehouse.QUERY_FORMATS, default="table",
                   help="table: aligned columns; csv; json: a list of objects; parquet (needs --out)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="write the result to FILE (its folder made when missing; nothing written if the query "
                        "fails) instead of printing it")


def _compare(p) -> None:
    p.add_argument("run_a", metavar="RUN_A", help="a run id: the baseline (A)")
    p.add_argument("run_b", metavar="RUN_B", help="a run id of the same model, compared with A (B - A)")
    add_settings(p, StudySpec, only=("warehouse",))
    p.add_argument("--sweep", choices=SWEEP_NAMES, default=None, help="only this sweep's cells (default: every sweep)")
    p.add_argument("--metric", choices=tuple(METRICS), default=None,
                   help="the metric compared (default: logprob_diff where both runs have it, else logit_diff)")
    p.add_argument("--measure", choices=tuple(COMPARED), default="effect",
                   help="the per-pair value averaged: effect (every pair) or recovery (pairs with a span kept)")
    p.add_argument("--top", type=int, default=None, metavar="N", help="only the N cells that differ most")
    _result_options(p)


def _models(sub) -> None:
    models = sub.add_parser("models", help="model folders", formatter_class=HelpFormatter)
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = _leaf(msub, "prepare", data.cmd_models_prepare, "build a model folder if missing and print its path")
    prep.add_argument("name", help=f"{', '.join(BUILTIN)}, a folder or a hub id")


def _one_pair(p) -> None:
    for name in PAIR:
        p.add_argument(name, required=True, help=PAIR_HELP[name])
    add_settings(p, StudySpec, only=ENGINE_SETTINGS)


def _patch(p) -> None:
    _one_pair(p)
    p.add_argument("--site", required=True, choices=PATCHABLE, help="the site patched")
    p.add_argument("--position", default="all", help="a position, a comma list, or all (each separately)")
    p.add_argument("--top", type=int, default=None,
                   help="show only the N rows that move the metric most (default: every row; neurons: 20)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _attention(p) -> None:
    p.add_argument("--text", required=True, help="the text whose attention is read (tokenised as the model's "
                                                 "tokenizer does, its special tokens added)")
    add_settings(p, StudySpec, only=ENGINE_SETTINGS)
    p.add_argument("--layers", default=None, help="layers, e.g. 0,2,5 or 0-3,7 (default: every layer)")
    p.add_argument("--heads", default=None, help="heads, e.g. 0,2 or 0-3 (default: every head)")
    p.add_argument("--top", type=int, default=3, help="the table shows the positions the last token reads most")
    p.add_argument("--json", action="store_true",
                   help='print {"tokens": [...], "patterns": [{"layer", "head", "weights"}]}, query rows by key '
                        "columns")


def _paths(p) -> None:
    _one_pair(p)
    add_settings(p, SweepConfig, only=pair.PATH_SETTINGS)
    p.add_argument("--position", default="roles",
                   help="roles (every position at once, the subject's last token, the last token), a position, "
                        "a comma list, or all (each separately)")
    p.add_argument("--top", type=int, default=20, help="the table shows the paths that move the metric most")
    p.add_argument("--json", action="store_true", help="print every path as JSON")


def _pairs(sub) -> None:
    pairs = sub.add_parser("pairs", help="prompt pairs", formatter_class=HelpFormatter)
    psub = pairs.add_subparsers(dest="pairs_command", required=True)
    check = _leaf(psub, "check", data.cmd_pairs_check, "pair and align a data set; print counts by status and reason")
    add_settings(check, StudySpec, only=("model", "pairs", "pairs_format", "require_known", "answer_policy", "backend"))
    add_settings(check, SweepConfig, only=("seed",))
    check.add_argument("--out", default="pairs.parquet", help="the pairs table written (what `sweep --pairs-table` "
                                                              "reads), its folder made when missing")


def _sweep(p) -> None:
    add_settings(p, StudySpec, only=("model", "limit", "backend", "dtype", "warehouse", "run_id"))
    p.add_argument("--pairs-table", required=True, metavar="FILE",
                   help="a pairs table written by `patchgrid pairs check` (its --out)")
    add_settings(p, SweepConfig)
    p.add_argument("--cache", default=".patchgrid-cache", help="activation cache folder")
    p.add_argument("--out", default="effects.parquet", help="the effect rows, also loaded into --warehouse")


def _study(p, summary: bool = False) -> None:
    study.add_config_option(p)
    add_settings(p, StudySpec)
    add_settings(p, SweepConfig)
    if summary:  # what a study prints when it ends (a served run prints nothing)
        out = p.add_mutually_exclusive_group()
        out.add_argument("--quiet", action="store_true", help="print only the run id (default: a summary)")
        out.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _demo(p) -> None:
    add_settings(p, StudySpec, only=("model", "backend", "limit", "warehouse"), defaults={"limit": 20})
    add_settings(p, SweepConfig, only=("trace_samples",), defaults={"trace_samples": 3})
    p.add_argument("--quick", action="store_true", help="only the France/Germany sweep")
