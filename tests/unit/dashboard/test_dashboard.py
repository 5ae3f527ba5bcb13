"""The live dashboard: its reads (patchgrid/dashboard/data.py) on a small warehouse built through the
loader, `patchgrid dashboard` refusing a missing warehouse, and the page in headless Chromium showing
a run's heatmap, then a second run loaded while it is open, without a restart."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from patchgrid.dashboard import data
from patchgrid.pairs import to_table
from patchgrid.warehouse.loader import WarehouseError, load_run, start_run
from tests.support.effect_rows import CLEAN, CORRUPT, baseline, make_pair, row, shifted, write_and_read_back

ROLES = ("subject_last", "further", "last")


N_LAYERS, N_HEADS = 3, 2


RELATIONS = ("capital", "currency")


def now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)  # rows.RUN's started: a naive UTC timestamp


def recovery(layer: int, role: str, i: int) -> float:
    """Pair i's recovery at a cell: the last token matters late, the subject early; pairs differ."""
    base = {"subject_last": 1 - layer / N_LAYERS, "further": 0.1, "last": layer / (N_LAYERS - 1)}[role]
    return round(base + (i - 1.5) / 10, 4)


def load(wh, run_id: str, n_pairs: int = 4) -> None:
    """A run of `n_pairs` pairs (relations alternating) with resid (layer x role) and heads rows."""
    pairs, baselines, rows = [], [], []
    for i in range(n_pairs):
        pid, relation = f"{run_id}-p{i}", RELATIONS[i % 2]
        pairs.append({"pair_id": pid, "relation": relation, "status": "accepted", "clean_prompt": f"c{i}",
                      "corrupt_prompt": f"x{i}", "roles": list(ROLES), "subject_start": 0, "subject_end": 1})
        clean = shifted(CLEAN, logit_diff=2.0 + i / 4)
        baselines.append(baseline(pid, clean, CORRUPT))
        pair = make_pair(pid, ROLES, relation)
        for layer in range(N_LAYERS):
            rows += [row(pair, recovery(layer, role, i), layer=layer, position=pos, clean=clean)
                     for pos, role in enumerate(ROLES)]
            rows += [row(pair, 0.2 * head, sweep="heads", site="head", layer=layer, head=head, clean=clean)
                     for head in range(N_HEADS)]
    effects, _ = write_and_read_back(rows, wh.parent / f"{run_id}-effects.parquet")
    start_run(wh, {"run_id": run_id, "model": "synthetic-model", "started": now(),
                   "params": {"sweeps": ["resid", "heads"], "metric": "logit_diff"}})
    load_run(wh, run_id, to_table(pairs), baselines, [effects])


@pytest.fixture
def warehouse(tmp_path):
    wh = tmp_path / "w.duckdb"
    load(wh, "run-one")
    return wh


def test_runs_latest_first_and_their_signature_changes_when_a_run_lands(warehouse):
    first = data.runs(warehouse)
    assert [(r["run_id"], r["status"], r["n_accepted"]) for r in first] == [("run-one", "completed", 4)]
    load(warehouse, "run-two", n_pairs=2)
    second = data.runs(warehouse)
    assert [r["run_id"] for r in second] == ["run-two", "run-one"]
    assert data.runs_signature(second) != data.runs_signature(first)
    assert data.runs_signature(data.runs(warehouse)) == data.runs_signature(second)


def test_filters_name_the_runs_sweeps_metrics_and_relations(warehouse):
    f = data.filters(warehouse, "run-one")
    assert f["sweeps"] == ["heads", "resid"] and f["directions"] == ["denoise"]
    assert "logit_diff" in f["metrics"] and "kl" in f["metrics"]
    assert f["relations"] == list(RELATIONS)


def test_cells_carry_means_intervals_and_pair_counts(warehouse):
    cells = data.cells(warehouse, "run-one", "resid", "denoise", "logit_diff")
    assert len(cells) == N_LAYERS * len(ROLES)
    assert list(dict.fromkeys(c["column"] for c in cells)) == list(ROLES)  # the prompt's order
    by_cell = {(c["layer"], c["column"]): c for c in cells}
    last = by_cell[(2, "last")]
    expected = sum(recovery(2, "last", i) for i in range(4)) / 4
    assert last["n_pairs"] == 4 and last["mean_recovery"] == pytest.approx(expected, abs=1e-4)
    assert last["ci95_low"] < last["mean_recovery"] < last["ci95_high"]
    assert data.value_column(cells) == "mean_recovery"
    heads = data.cells(warehouse, "run-one", "heads", "denoise", "logit_diff")
    assert sorted({c["column"] for c in heads}) == ["all · head 0", "all · head 1"]


def test_a_relation_filter_reads_that_relations_pairs_only(warehouse):
    cells = data.cells(warehouse, "run-one", "resid", "denoise", "logit_diff", relation="currency")
    cell = next(c for c in cells if (c["layer"], c["column"]) == (0, "subject_last"))
    assert cell["n_pairs"] == 2 and cell["relation"] == "currency"  # pairs 1 and 3
    expected = (recovery(0, "subject_last", 1) + recovery(0, "subject_last", 3)) / 2
    assert cell["mean_recovery"] == pytest.approx(expected, abs=1e-4)
    assert data.pair_ids(warehouse, "run-one", "resid", "currency") == ["run-one-p1", "run-one-p3"]


def test_one_pairs_grid_and_the_pairs_of_one_cell(warehouse):
    grid = data.pair_grid(warehouse, "run-one", "run-one-p2", "resid", "denoise", "logit_diff")
    assert {(g["layer"], g["column"]): g["recovery"] for g in grid} == pytest.approx(
        {(layer, role): recovery(layer, role, 2) for layer in range(N_LAYERS) for role in ROLES}, abs=1e-4)
    at = data.cell_pairs(warehouse, "run-one", "resid", "denoise", "logit_diff", {"layer": 2, "column": "last"})
    assert [p["pair_id"] for p in at] == [f"run-one-p{i}" for i in (3, 2, 1, 0)]  # the largest |effect| first


def test_a_missing_warehouse_is_named(tmp_path):
    with pytest.raises(WarehouseError, match="nowhere.duckdb does not exist"):
        data.runs(tmp_path / "nowhere.duckdb")

