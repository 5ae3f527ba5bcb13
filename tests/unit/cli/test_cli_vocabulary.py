"""One command-line vocabulary: one flag per setting with its declared default in every
command, every default in --help, --verbose everywhere, a setting that cannot apply refused in one
line, answers tokenised by the data sets' rule with a warning for one of several tokens, and a model
folder transformers refuses named with transformers' reason."""
from __future__ import annotations

import argparse

import pytest

from patchgrid.cli import build_parser, main
from patchgrid.pipeline.spec import StudySpec
from patchgrid.settings import SpecError, settings_fields
from patchgrid.sweeps import SweepConfig

DECLARED = {f.name: f.default for cls in (StudySpec, SweepConfig) for f in settings_fields(cls)}


OWN_DEFAULTS = {"demo": {"limit", "trace_samples"}}  # the demo's small study, said in its --help


def commands(parser=None, prefix=()):
    """(name, parser) of every command that runs, subcommands of `models` and `pairs` included."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub.get_default("func"):
                    yield " ".join((*prefix, name)), sub
                yield from commands(sub, (*prefix, name))


def test_every_command_takes_verbose_and_shows_every_default():
    names = [name for name, _ in commands()]
    assert {"models prepare", "pairs check", "patch", "paths", "sweep", "study", "serve", "report", "dashboard",
            "query", "demo"} <= set(names)
    for name, sub in commands():
        flags = {s for a in sub._actions for s in a.option_strings}
        assert "--verbose" in flags, name
        assert "--source" not in flags, name  # the data set is --pairs everywhere
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.required or isinstance(action, argparse._HelpAction):
                continue
            shown = formatter._expand_help(action)
            assert "default" in shown, f"{name} {action.option_strings[0]}: {shown!r}"


def test_a_setting_has_its_declared_default_in_every_command():
    """require_known among them: pairs check judges pairs as a study does."""
    seen = set()
    for name, sub in commands():
        for action in sub._actions:
            if action.dest in DECLARED and action.dest not in OWN_DEFAULTS.get(name, ()):
                declared = DECLARED[action.dest]
                want = ",".join(f"{x:g}" if isinstance(x, float) else x for x in declared) \
                    if isinstance(declared, tuple) else declared
                assert action.default == want, f"{name} {action.option_strings[0]}: {action.default!r} != {want!r}"
                seen.add((name, action.dest))
    assert ("pairs check", "require_known") in seen and ("pairs check", "pairs") in seen
    check = build_parser().parse_args(["pairs", "check"])
    assert check.require_known is True and check.pairs == StudySpec().pairs
    assert build_parser().parse_args(["sweep", "--pairs-table", "t.parquet"]).pairs_table == "t.parquet"


REFUSED = [
    (["study", "--sweeps", "resid", "--gpus-per-engine", "1", "--ray-workers", "9"],
     "--ray-workers applies only with --runner ray (the runner is local)"),
    (["sweep", "--pairs-table", "none.parquet", "--sweeps", "resid", "--path-mlps", "recomputed"],
     "--path-mlps applies only to the paths sweep (--sweeps resid)"),
    (["study", "--sweeps", "resid", "--gpus-per-engine", "1"],
     "--gpus-per-engine applies only with --runner ray (the runner is local)"),
    (["serve", "--cron", "0 3 * * *", "--tensor-parallel-size", "2"],
     "--tensor-parallel-size applies only with --runner ray (the runner is local)"),
    (["study", "--sweeps", "resid", "--path-senders", "head.1.1"],
     "--path-senders applies only to the paths sweep (--sweeps resid)"),
    (["study", "--sweeps", "resid,heads", "--verify-top", "5"],
     "--verify-top applies only to the atp and edges sweeps (--sweeps resid,heads)"),
    (["study", "--sweeps", "resid", "--trace-samples", "3"],
     "--trace-samples applies only to the trace sweep (--sweeps resid)"),
    (["study", "--sweeps", "resid", "--atp-dtype", "bfloat16"],
     "--atp-dtype applies only to the atp and edges sweeps (--sweeps resid)"),
]


@pytest.mark.parametrize("args, message", REFUSED)
def test_each_command_refuses_a_setting_that_cannot_apply(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    assert main([*args, "--model", "tiny-llama", "--warehouse", "w.duckdb"]) == 2
    assert capsys.readouterr().err.strip() == f"patchgrid: error: {message}"
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


def test_the_python_api_and_the_flow_refuse_it_too(tmp_path):
    import patchgrid
    from patchgrid.flows.study import study

    with pytest.raises(SpecError, match=r"ray_workers applies only with --runner ray \(the runner is local\)"):
        patchgrid.study(model="tiny-llama", ray_workers=9, warehouse=str(tmp_path / "w.duckdb"))
    with pytest.raises(Exception, match="verify_top applies only to the atp and edges sweeps"):
        study.validate_parameters({"spec": {"sweep": {"sweeps": ["resid"], "verify_top": 5}}})
    assert not (tmp_path / "w.duckdb").exists()
    # at their defaults, or where they apply, they are taken
    assert StudySpec.of(runner="ray", ray_workers=9, gpus_per_engine=1.0).ray_workers == 9
    assert StudySpec.of(sweeps="resid,atp,paths", verify_top=5, path_senders="head.1.1").sweep.verify_top == 5



@pytest.mark.parametrize("args, flag", [
    (["study", "--sweep", "resid"], "--sweep"),  # not --sweeps
    (["serve", "--cron", "0 3 * * *", "--sweep", "resid"], "--sweep"),
    (["sweep", "--pairs-table", "p.parquet", "--sweep", "resid"], "--sweep"),
    (["pairs", "check", "--pairs", "p.jsonl", "--out", "o.jsonl", "--no-require"], "--no-require"),
    (["study", "--conf", "study.toml"], "--conf"),  # not --config
])
def test_a_flag_is_taken_only_written_whole(tmp_path, monkeypatch, capsys, args, flag):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main([*args, "--model", "tiny-llama"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and flag in err, err
    assert list(tmp_path.iterdir()) == []

