"""Two runs compared (warehouse/compare.py, `patchgrid compare`, Warehouse.compare): the difference B - A
per cell with a paired t interval over shared pairs or Welch's otherwise, each checked against the
formulas computed here (the t quantile by integrating Student's density), on two real runs (tiny-llama,
seeds 0 and 1: some pairs keep their partner, some do not) and on hand-built runs; cells one run lacks
kept; refusals in one line."""
from __future__ import annotations

import subprocess
import sys


def test_cli_prints_the_table_and_refuses_in_one_line(real_runs, tmp_path):
    wh, run_a, run_b = real_runs

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "patchgrid", "compare", *args, "--warehouse", str(wh)],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)

    res = cli(run_a, run_b, "--sweep", "resid", "--top", "3")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:4] == ["sweep", "site", "direction", "layer"] and "interval" in lines[0]
    assert lines[-1] == "(3 rows)" and "logprob_diff" in lines[1] and "paired" in res.stdout
    for args, message in (((run_a, run_a), "given twice"), ((run_a, "run-nope"), f"its runs, newest first: {run_b}")):
        res = cli(*args)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        [line] = res.stderr.strip().splitlines()
        assert line.startswith("patchgrid: error: compare:") and message in line

