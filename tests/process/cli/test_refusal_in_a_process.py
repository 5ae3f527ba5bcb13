"""A command run as a process refuses bad input as it does in process (the catalogue:
tests/unit/cli/test_refusals.py): exit code 2 and one `patchgrid: error:` line on stderr, no
traceback, nothing written."""
from __future__ import annotations

from tests.support.pairs import DATA
from tests.support.processes import cli, one_line_error


def test_a_refused_study_exits_2_with_one_line(tmp_path):
    res = cli("study", "--model", "tiny-llama", "--pairs", str(DATA), "--limit", "0", "--warehouse",
              str(tmp_path / "w.duckdb"), "--workdir", str(tmp_path / "work"), cwd=tmp_path)
    one_line_error(res, "--limit 0 must be at least 1")
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert list(tmp_path.iterdir()) == []
