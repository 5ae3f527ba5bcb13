"""One command-line vocabulary (issue 29): one flag per setting with its declared default in every
command, every default in --help, --verbose everywhere, a setting that cannot apply refused in one
line, answers tokenised by the data sets' rule with a warning for one of several tokens, and a model
folder transformers refuses named with transformers' reason."""
from __future__ import annotations

import argparse
import json

import pytest

from patchgrid.cli import build_parser, main
from patchgrid.pipeline.spec import StudySpec
from patchgrid.settings import SpecError, settings_fields
from patchgrid.sweeps import SweepConfig
from tests.support.processes import cli, one_line_error

PAIR = ["--clean", "The capital of France is", "--corrupt", "The capital of Spain is"]
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


@pytest.mark.engine  # an engine in this process too
def test_answers_on_the_command_line_are_tokenised_as_a_data_sets_and_a_split_one_is_warned(capsys):
    """`Paris` after a prompt is ` Paris`, as in a pairs file; `Abuja` is five tokens of tiny-llama's
    tokenizer: one warning line names them and says how the answer is scored."""
    common = ["patch", "--model", "tiny-llama", *PAIR, "--site", "resid", "--position", "4", "--backend", "hf",
              "--json"]
    typed = cli(*common, "--clean-answer", "Paris", "--corrupt-answer", "Abuja")
    assert typed.returncode == 0, typed.stderr
    warnings = [line for line in typed.stderr.splitlines() if line.startswith("patchgrid: warning:")]
    assert warnings == ["patchgrid: warning: --corrupt-answer 'Abuja' is 5 tokens [' A', 'b', 'u', 'j', 'a']: "
                        "scored whole after the prompt (teacher-forced), on the log-probability difference "
                        "(logprob_diff) rather than the logit difference of one token"], typed.stderr
    assert main([*common, "--clean-answer", " Paris", "--corrupt-answer", " Abuja"]) == 0
    spaced = capsys.readouterr()
    assert json.loads(typed.stdout) == json.loads(spaced.out)
    assert json.loads(spaced.out)["baseline"]["metric"] == "logprob_diff"
    assert main([*common, "--clean-answer", "Paris", "--corrupt-answer", "Madrid"]) == 0  # one token each
    one_token = capsys.readouterr()
    assert "warning" not in one_token.err and json.loads(one_token.out)["baseline"]["metric"] == "logit_diff"


def test_a_model_folder_transformers_refuses_is_one_line_with_its_reason(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 130, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 512}))
    res = cli("patch", "--model", str(folder), *PAIR, "--clean-answer", "Paris", "--corrupt-answer", "Madrid",
              "--site", "resid", "--backend", "hf", timeout=120)
    one_line_error(res, f"model folder {str(folder)!r}: transformers cannot read its config.json: The hidden size "
                        "(130) is not a multiple of the number of attention heads (4).")
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
