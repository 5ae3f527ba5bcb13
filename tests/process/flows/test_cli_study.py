"""`patchgrid study` as a researcher runs it, a process: the summary on stdout alone, the progress on
stderr, and the two commands it ends with working as printed. What a study of each kind writes, and the
summary for scripts (--json, --quiet), run in process: tests/flow/flows/test_cli_study.py."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys

from patchgrid.warehouse.loader import query
from tests.support.engines import needs_vllm
from tests.support.pairs import DATA


def cli(*args, timeout=600, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "patchgrid", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@needs_vllm
def test_study_ends_with_a_summary_whose_commands_work_as_printed(tmp_path, prefect_server_api):
    wh = tmp_path / "w.duckdb"
    # the hf backend: what the study prints is the point here, not the engine (which starts in a second on hf)
    args = ("study", "--model", "tiny-llama", "--pairs", str(DATA), "--limit", "2", "--no-require-known",
            "--sweeps", "resid", "--backend", "hf", "--warehouse", str(wh), "--workdir", str(tmp_path / "work"))
    res = cli(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    run_id = lines[-1]  # the last line is the run id alone, as --quiet prints it
    assert run_id.startswith("run-") and "cached" not in res.stdout  # the flow's own lines go to stderr
    assert "patched runs" in res.stderr  # the progress bars
    assert re.fullmatch(rf"run {run_id} completed in \d+\.\d s: model tiny-llama, warehouse {re.escape(str(wh))}",
                        lines[0])
    (counts,) = query(wh, "SELECT count(*), count(*) FILTER (WHERE status = 'accepted'), "
                          "count(*) FILTER (WHERE status = 'rejected') FROM pairs")[1]
    reasons = query(wh, "SELECT reason, n FROM rejections ORDER BY n DESC, reason")[1]
    assert lines[1] == (f"records: {counts[0]} read, {counts[1]} accepted, {counts[2]} rejected ("
                        + ", ".join(f"{reason} {n}" for reason, n in reasons) + ")")
    (n_effects,) = query(wh, "SELECT count(*) FROM effects")[1][0]
    at = lines.index("sweep  pairs  effect_rows  patched_runs")
    assert lines[at + 1].split() == ["resid", "2", str(n_effects), str(n_effects)] and lines[at + 2] == "(1 rows)"
    at = next(k for k, line in enumerate(lines) if line.split()[:3] == ["sweep", "cell", "metric"])
    assert lines[at].split() == ["sweep", "cell", "metric", "n_pairs", "mean_of", "mean", "ci95_low", "ci95_high"]
    cells = lines[at + 1:at + 7]  # the 3 strongest of resid clean into corrupt, then corrupt into clean
    assert lines[at + 7] == "(6 rows)" and ["(noise)" in c for c in cells] == [False] * 3 + [True] * 3
    for cell in cells:
        words = cell.replace(" (noise)", "").split()
        assert words[0] == "resid" and words[4:6] == ["logprob_diff", "2"] and words[6] in ("recovery", "effect")
        low, mean, high = (float(w) for w in (words[8], words[7], words[9]))
        assert low <= mean <= high
    # the two commands it gives work as printed
    query_line, report_line = (next(x for x in lines if x.startswith(p)) for p in ("query:  ", "report: "))
    q = cli(*shlex.split(query_line.split(None, 1)[1])[1:], cwd=tmp_path)
    assert q.returncode == 0 and q.stdout.strip().splitlines()[-1] == "(20 rows)", q.stderr
    rep = cli(*shlex.split(report_line.split(None, 1)[1])[1:], cwd=tmp_path)
    assert rep.returncode == 0 and (tmp_path / "report" / "report.html").is_file(), rep.stderr[-3000:]
