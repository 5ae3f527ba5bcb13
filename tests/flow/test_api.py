"""The Python API (patchgrid.open, patchgrid.study): views as pandas frames through the query sandbox,
the latest completed run by default, errors naming the valid views and columns; and one study run
in process, on tiny-llama, through its summary, frames and report."""
from __future__ import annotations

import patchgrid
from tests.support.engines import needs_vllm
from tests.support.pairs import DATA


@needs_vllm
def test_a_study_in_process(prefect_api, tmp_path):
    wh = tmp_path / "warehouse.duckdb"
    run = patchgrid.study(model="tiny-llama", pairs=str(DATA), sweeps="resid", limit=2, require_known=False,
                          warehouse=str(wh), workdir=str(tmp_path / "work"))
    assert run.run_id.startswith("run-")
    summary = run.summary()
    assert summary["status"] == "completed" and summary["model"] == "tiny-llama"
    assert [(s["sweep"], s["pairs"]) for s in summary["sweeps"]] == [("resid", 2)]
    assert summary["strongest"] and all(c["sweep"] == "resid" and c["metric"] for c in summary["strongest"])
    cells = run.view("effect_summary", metric="logprob_diff")
    assert set(cells.run_id) == {run.run_id} and cells.n_pairs.max() == 2  # a role only one pair has: 1
    assert patchgrid.open(wh).latest_run() == run.run_id
    page = run.report(tmp_path / "report")
    assert page == tmp_path / "report" / "report.html" and run.run_id in page.read_text()

