"""`patchgrid study --config study.toml` as a researcher runs it, in this process (`patchgrid.cli.main`)
against the session's Prefect API: the file's settings, a flag over one of them, the file's text in the
run's recorded parameters, --layers restricting the effect rows, --name shown in the warehouse's runs and
the summary; a bad file, or a layer the model does not have, refused in one line before anything runs.
One study for the module (tiny-llama, hf)."""
from __future__ import annotations

import json

import pytest

from patchgrid.warehouse.loader import query
from tests.support.pairs import DATA
from tests.support.processes import cli_here as cli

STUDY_FILE = f"""# two pairs of tiny-llama, its residual stream and heads at three of its four layers, two positions
model = "tiny-llama"
pairs = "{DATA}"
backend = "hf"
sweeps = "resid,heads"
layers = "0,2-3"
positions = [1, 3]
limit = 3
require-known = false
name = "from the file"
"""


@pytest.fixture(scope="module")
def study(prefect_api, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study-file")
    (tmp / "study.toml").write_text(STUDY_FILE)
    wh = tmp / "w.duckdb"
    res = cli("study", "--config", "study.toml", "--limit", "2", "--name", "from a flag", "--json",
              "--warehouse", str(wh), "--workdir", str(tmp / "work"), cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    return wh, json.loads(res.stdout)


def test_the_files_settings_a_flags_override_and_the_files_text_are_recorded(study):
    wh, summary = study
    (params,) = query(wh, "SELECT params FROM runs WHERE run_id = ?", [summary["run_id"]])[1][0]
    params = json.loads(params) if isinstance(params, str) else params
    assert (params["model"], params["backend"], params["sweeps"], params["require_known"]) == \
        ("tiny-llama", "hf", ["resid", "heads"], False)
    assert params["limit"] == 2  # --limit 2 over the file's 3
    assert params["config"] == STUDY_FILE and params["layers"] == [0, 2, 3]
    assert [s["pairs"] for s in summary["sweeps"]] == [2, 2]


def test_layers_and_positions_restrict_the_effect_rows(study):
    wh, summary = study
    got = query(wh, "SELECT sweep, list(DISTINCT layer ORDER BY layer), list(DISTINCT position ORDER BY position) "
                    "FROM effects WHERE run_id = ? GROUP BY sweep ORDER BY sweep", [summary["run_id"]])[1]
    assert got == [("heads", [0, 2, 3], [1, 3]), ("resid", [0, 2, 3], [1, 3])]


def test_the_name_is_in_the_runs_and_the_summary(study):
    import patchgrid

    wh, summary = study
    assert summary["name"] == "from a flag"  # --name over the file's
    runs = patchgrid.open(wh).runs()
    assert runs.loc[runs.run_id == summary["run_id"], "name"].tolist() == ["from a flag"]


@pytest.mark.parametrize("content, message", [
    ("limt = 2\n", "study.toml: unknown setting 'limt' (did you mean 'limit'?)"),  # bad values: test_study_config
    ('model = "tiny-llama"\nlayers = "1,4"\n', "--layers 4: tiny-llama has 4 layers (0-3)"),
])
def test_a_bad_file_or_a_layer_past_the_model_is_refused_in_one_line(prefect_api, tmp_path, content, message):
    (tmp_path / "study.toml").write_text(content)
    res = cli("study", "--config", "study.toml", "--warehouse", str(tmp_path / "w.duckdb"), cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("patchgrid: error: ") and message in res.stderr, \
        res.stderr
    assert not (tmp_path / "w.duckdb").exists()
