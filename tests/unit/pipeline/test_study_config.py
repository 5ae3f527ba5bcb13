"""A study file (patchgrid.pipeline.studyfile; `patchgrid study --config FILE`, `serve --config`,
`patchgrid.study(config=...)`): settings by name (and by the flag's spelling), each checked by its own
declaration, the flags given on the command line over the file's, the file's text the `config` setting;
an unknown key or a bad value refused in one line naming the file and the key. Parsing only, no study
(tests/process/flows/test_study_file.py runs one from a file)."""
from __future__ import annotations

import re

import pytest

from patchgrid.cli import build_parser
from patchgrid.cli.options import settings_from
from patchgrid.pipeline.spec import StudySpec
from patchgrid.pipeline.studyfile import StudyFileError, read_study_file
from patchgrid.sweeps import SweepConfig
from tests.support.paths import REPO
from tests.support.reruns import identity_params

REPO = REPO
EXAMPLE = REPO / "docs" / "examples" / "study.toml"
FILE = """# a study in a file
model = "tiny-llama"
limit = 3
sweeps = ["resid", "heads"]
layers = "0,2-3"
require-known = false   # the flag's spelling
format = "counterfact"  # --format is pairs_format
head_position_roles = "last"  # a setting the command line does not offer
seed = 5
backend = "hf"
name = "from the file"
"""


@pytest.fixture
def study_file(tmp_path):
    path = tmp_path / "study.toml"
    path.write_text(FILE)
    return path


def spec_of(argv) -> StudySpec:
    args = build_parser().parse_args(argv)
    return StudySpec.of(**settings_from(args, StudySpec), **settings_from(args, SweepConfig))


def test_a_file_gives_settings_by_name_and_by_flag_spelling(study_file):
    settings, text = read_study_file(study_file)
    assert text == FILE
    assert settings == {"model": "tiny-llama", "limit": 3, "sweeps": ("resid", "heads"), "layers": (0, 2, 3),
                        "require_known": False, "pairs_format": "counterfact", "head_position_roles": ("last",),
                        "seed": 5, "backend": "hf", "name": "from the file"}


@pytest.mark.parametrize("command", [["study"], ["serve", "--cron", "0 3 * * *"]])
def test_flags_given_override_the_file_and_the_files_text_is_recorded(study_file, command):
    spec = spec_of([*command, "--limit", "2", "--backend", "vllm", "--config", str(study_file), "--seed", "0"])
    # --backend vllm and --seed 0 are the defaults, given: they override the file all the same
    assert (spec.limit, spec.backend, spec.sweep.seed) == (2, "vllm", 0)
    assert (spec.sweeps, spec.sweep.layers, spec.require_known, spec.pairs_format, spec.sweep.head_position_roles) == \
        (("resid", "heads"), (0, 2, 3), False, "counterfact", ("last",))
    recorded = spec.recorded_params()
    assert recorded["config"] == FILE and recorded["name"] == "from the file" and recorded["layers"] == [0, 2, 3]
    assert "config" not in identity_params(spec) and "name" not in identity_params(spec)
    assert identity_params(spec) == identity_params(spec.replace(config=None, name=None))


def test_without_a_file_nothing_is_recorded_of_one():
    assert spec_of(["study"]).recorded_params()["config"] is None


def test_serve_names_its_deployment_and_its_runs_with_name():
    spec = spec_of(["serve", "--cron", "0 3 * * *", "--name", "nightly"])
    assert spec.name == "nightly"


@pytest.mark.parametrize("content, message", [
    ("limt = 2", "unknown setting 'limt' (did you mean 'limit'?)"),
    ("config = 'x'", "unknown setting 'config'"),
    ("[sweep]\nseed = 1", "unknown setting 'sweep'"),
    ('limit = "two"', "limit 'two' is not an integer"),
    ("limit = 0", "limit 0 must be at least 1"),
    ("require_known = 1", "require_known 1 is not true or false"),
    ('sweeps = "resid,nope"', "sweeps: unknown sweep 'nope'; use some of resid,"),
    ('backend = "tpu"', "backend 'tpu' is not one of"),
    ("layers = \"x\"", "layers 'x' is not a number nor a range a-b"),
    ("trace_noise = -1", "trace_noise -1.0 must be above 0"),
    ('pairs_format = "counterfact"\nformat = "known"', "format: the setting pairs_format is given twice"),
    ("limit = ", "not TOML: "),
])
def test_a_bad_key_or_value_is_refused_naming_the_file_and_the_key(tmp_path, content, message):
    path = tmp_path / "bad.toml"
    path.write_text(content + "\n")
    with pytest.raises(StudyFileError) as err:
        read_study_file(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_a_missing_file_is_refused_by_the_parser_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["study", "--config", str(tmp_path / "none.toml")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"patchgrid: error: {tmp_path / 'none.toml'}: no such study file\n"


def test_the_python_api_reads_the_file_through_the_same_reader(tmp_path):
    import patchgrid

    path = tmp_path / "bad.toml"
    path.write_text("limt = 2\n")
    with pytest.raises(StudyFileError, match=re.escape(f"{path}: unknown setting 'limt'")):
        patchgrid.study(config=path)


def test_the_tutorials_study_file_is_the_one_shipped_and_it_reads():
    """docs/tutorial.md shows docs/examples/study.toml whole (tests/unit/docs parse its command, which reads it)."""
    tutorial = (REPO / "docs" / "tutorial.md").read_text()
    shown = re.search(r"```toml\n(.*?)```", tutorial, re.S).group(1)
    assert shown == EXAMPLE.read_text()
    settings, _ = read_study_file(EXAMPLE)
    assert settings["layers"] and settings["name"]
