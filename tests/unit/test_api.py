"""The Python API (patchgrid.open, patchgrid.study): views as pandas frames through the query sandbox,
the latest completed run by default, errors naming the valid views and columns; and one study run
in process, on tiny-llama, through its summary, frames and report."""
from __future__ import annotations

import importlib.util
from datetime import datetime

import pandas as pd
import pytest

import patchgrid
from patchgrid.api import ALL, Run
from patchgrid.pairs import to_table as pairs_table
from patchgrid.rows.effects import write_effects
from patchgrid.settings import SpecError
from patchgrid.warehouse.loader import WarehouseError, finish_run, load_run, start_run
from tests.support.effect_rows import baseline, make_pair, row

ROLES = ("subject_last", "last")


def _pair_row(pid: str, relation: str) -> dict:
    return {"pair_id": pid, "relation": relation, "status": "accepted", "clean_prompt": "c", "corrupt_prompt": "x",
            "roles": list(ROLES), "subject_start": 0, "subject_end": 1}


def _load(wh, tmp_path, run_id: str, day: int, recovery: float, *, status="completed"):
    """A run of four pairs over two relations, two layers of the resid sweep, started on `day`."""
    pairs = [(f"p{i}", "capital" if i < 2 else "language") for i in range(4)]
    rows = [row(make_pair(pid, ROLES, relation=rel), recovery + 0.1 * layer + 0.01 * i, layer=layer, position=1)
            for i, (pid, rel) in enumerate(pairs) for layer in (0, 1)]
    start_run(wh, {"run_id": run_id, "model": "m", "started": datetime(2026, 1, day)})
    load_run(wh, run_id, pairs_table([_pair_row(pid, rel) for pid, rel in pairs] +
                                     [{**_pair_row("q", "capital"), "status": "rejected", "reason": "no_partner"}]),
             [baseline(pid) for pid, _ in pairs], [write_effects(rows, tmp_path / f"{run_id}.parquet")],
             finished=datetime(2026, 1, day, 1))
    if status != "completed":
        finish_run(wh, run_id, status, finished=datetime(2026, 1, day, 2), reason="stopped")


@pytest.fixture
def wh(tmp_path):
    """Three runs: `old` and `new` completed, `newest` failed after its load."""
    path = tmp_path / "warehouse.duckdb"
    _load(path, tmp_path, "old", 1, 0.2)
    _load(path, tmp_path, "new", 2, 0.5)
    _load(path, tmp_path, "newest", 3, 0.9, status="failed")
    return path


def test_runs_newest_first_as_pandas(wh):
    runs = patchgrid.open(wh).runs()
    assert isinstance(runs, pd.DataFrame)
    assert list(runs.run_id) == ["newest", "new", "old"]
    assert list(runs.status) == ["failed", "completed", "completed"]
    assert list(runs.n_accepted) == [4, 4, 4] and list(runs.n_rejected) == [1, 1, 1]


def test_view_reads_the_latest_completed_run_by_default(wh):
    w = patchgrid.open(wh)
    assert w.latest_run() == "new"
    cells = w.view("effect_summary", metric="logit_diff")
    assert set(cells.run_id) == {"new"} and sorted(cells.layer) == [0, 1]
    assert cells.set_index("layer").mean_recovery[0] == pytest.approx(0.515, abs=1e-4)  # 0.5 + mean(0..0.03)
    assert set(w.view("effect_summary", run="old").run_id) == {"old"}
    assert set(w.view("effect_summary", run=ALL, metric="logit_diff").run_id) == {"old", "new", "newest"}


def test_view_filters_and_columns(wh):
    w = patchgrid.open(wh)
    by_relation = w.view("relation_summary", relation="capital", sweep="resid", metric="logit_diff",
                         columns=["relation", "layer", "n_pairs"])
    assert list(by_relation.columns) == ["relation", "layer", "n_pairs"]
    assert set(by_relation.relation) == {"capital"} and list(by_relation.n_pairs) == [2, 2]
    assert w.view("effect_summary", sweep="heads").empty
    metrics = w.view("metrics")  # no run_id column: every row, no run asked for
    assert "logprob_diff" in set(metrics.metric)


def test_unknown_view_or_column_names_the_valid_ones(wh):
    w = patchgrid.open(wh)
    with pytest.raises(WarehouseError) as info:
        w.view("effect_sumary")
    message = str(info.value)
    assert "effect_sumary" in message and "did you mean 'effect_summary'" in message
    assert "relation_summary" in message and "run_overview" in message  # the valid views
    assert isinstance(info.value.__cause__, WarehouseError)  # DuckDB's own error, kept
    assert "does not exist" in message
    with pytest.raises(WarehouseError, match=r"no column in view effect_summary 'relation'.*valid: run_id, sweep"):
        w.view("effect_summary", relation="capital")
    with pytest.raises(WarehouseError, match=r"no column in view pairs 'layr' \(did you mean 'layer'\?\)|"
                                             r"no column in view pairs 'layr'"):
        w.view("pairs", columns=["pair_id", "layr"])


def test_reads_only_through_the_sandbox(wh, tmp_path):
    w = patchgrid.open(wh)
    with pytest.raises(WarehouseError, match="query refused"):
        w.sql("DELETE FROM runs")
    with pytest.raises(WarehouseError, match="query refused"):
        w.sql(f"COPY (SELECT 1) TO '{tmp_path / 'out.csv'}'")
    assert not (tmp_path / "out.csv").exists()
    assert list(w.sql("SELECT count(*) AS n FROM runs WHERE status = ?", ["completed"]).n) == [2]


def test_a_warehouse_that_is_not_there_or_has_no_completed_run(tmp_path):
    with pytest.raises(WarehouseError, match="does not exist"):
        patchgrid.open(tmp_path / "nowhere.duckdb")
    path = tmp_path / "w.duckdb"
    _load(path, tmp_path, "only", 1, 0.5, status="failed")
    with pytest.raises(WarehouseError, match="no completed run"):
        patchgrid.open(path).view("effect_summary")


def test_polars_on_request(wh):
    if importlib.util.find_spec("polars") is None:
        with pytest.raises(ImportError, match="needs the package polars"):
            patchgrid.open(wh, frame="polars").runs()
    else:
        import polars as pl

        assert isinstance(patchgrid.open(wh).runs(frame="polars"), pl.DataFrame)
    with pytest.raises(ValueError, match="frame 'arrow' is not one of pandas, polars"):
        patchgrid.open(wh, frame="arrow")


def test_run_summary_of_a_loaded_run(wh):
    summary = Run("new", wh).summary(per_sweep=1)
    assert summary["status"] == "completed"
    assert summary["records"] == {"read": 5, "accepted": 4, "rejected": 1, "not_judged": 0,
                                  "rejected_by_reason": {"no_partner": 1}}
    [sweep] = summary["sweeps"]
    assert sweep["sweep"] == "resid" and sweep["pairs"] == 4 and sweep["effect_rows"] == 8
    [cell] = summary["strongest"]
    assert cell["layer"] == 1 and cell["metric"] == "logit_diff" and cell["ci95_low"] < cell["mean"]


def test_study_refuses_an_unknown_setting_before_anything_runs():
    with pytest.raises(SpecError, match="unknown setting 'sweepz'"):
        patchgrid.study(model="tiny-llama", sweepz="resid")

