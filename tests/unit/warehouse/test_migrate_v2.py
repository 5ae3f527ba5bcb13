"""Schema v2 to v3 (warehouse/migrate.py): a warehouse as patchgrid wrote it before loads filed effect
rows by their shape (tests/unit/warehouse/v2_loads.py: every kind's rows in one wide file, knockout rows as a
noising patch of the pattern, the kinds recorded by how the report draws them, or not at all) is
migrated by the first patchgrid to open it, and then reads exactly as the same rows loaded today:
every view, row for row."""
from __future__ import annotations

import duckdb
import pytest

from patchgrid.pairs import to_table as pairs_table
from patchgrid.rows.effects import write_effects
from patchgrid.sweeps.registry import row_shapes
from patchgrid.warehouse.layout import SCHEMA_VERSION, Layout
from patchgrid.warehouse.loader import connect, load_run, query, start_run
from tests.unit.report.test_report_knockout import knockout_rows
from tests.unit.report.test_report_knockout import pair_record as fact_record
from tests.unit.warehouse import test_atp_views, test_path_views
from tests.unit.warehouse.test_circuit_views import circuit_rows
from tests.unit.warehouse.test_edge_views import edge_rows
from tests.unit.warehouse.test_views import effect, pair
from tests.unit.warehouse.v2_loads import v2_effects, v2_load, v2_warehouse

TRACE_ROLES = ("subject_last", "after_subject", "last")


@pytest.fixture(scope="module")
def runs():
    """run id -> (pair records, baselines, effect rows made today, how v2 recorded its kinds)."""
    atp, exact = test_atp_views.synthetic()
    paths = test_path_views.path_rows()
    edges, _ = edge_rows(verify=(2, 2))
    circuit, _, _ = circuit_rows()
    knockout, fact_baselines = knockout_rows()
    trace = [effect(f"p{i}", 0, roles=TRACE_ROLES, position=pos, sweep="trace", metric="p", p=p,
                    noised_p=0.1 + 0.01 * i, layer=layer)
             for i in range(3) for layer in range(2) for pos, p in enumerate((0.5, 0.3, 0.6))]
    six = [test_atp_views.pair_record(f"p{i}") for i in range(6)]
    path_pairs = [test_path_views.pair_record(f"p{i}") for i in range(test_path_views.N_PAIRS)]
    facts = [fact_record(f"f{i}") for i in range(len(fact_baselines))]
    traced = [pair(f"p{i}", roles=TRACE_ROLES) for i in range(3)]
    return {
        "atp": (six, [], atp + exact, True),
        "paths": (path_pairs, [], paths, True),
        "edges": (path_pairs, [], edges, True),
        "circuit": (path_pairs, [], circuit, True),
        "knockout": (facts, fact_baselines, knockout, True),
        "every-kind": (six + facts, fact_baselines, atp + exact + paths + edges + circuit + knockout + trace, True),
        # loads that recorded no kinds: v2 took the sweeps on p(answer) as noised (only tracing's were)
        "no-record": (traced, [], trace + atp[:40] + exact[:40], None),
        "empty-record": (traced, [], trace + exact[:40], False),
    }


@pytest.fixture(scope="module")
def warehouses(tmp_path_factory, runs):
    """The runs in a v2 warehouse, migrated by a reader's first query; and loaded today into another."""
    tmp = tmp_path_factory.mktemp("migrate")
    old, today = tmp / "old.duckdb", tmp / "today.duckdb"
    layout = v2_warehouse(old)
    for run_id, (pairs, baselines, rows, recorded) in runs.items():
        v2_load(layout, run_id, pairs_table(pairs), baselines, v2_effects(rows), recorded)
        start_run(today, {"run_id": run_id, "model": "m", "params": "{}"})
        load_run(today, run_id, pairs_table(pairs), baselines, [write_effects(rows, tmp / f"{run_id}.parquet")],
                 sweep_kinds=row_shapes())
    return old, today


def test_a_reader_migrates_a_v2_warehouse_once_and_says_so(tmp_path, runs, capsys):
    wh = tmp_path / "w.duckdb"
    layout = v2_warehouse(wh)
    for run_id in ("atp", "knockout"):
        pairs, baselines, rows, recorded = runs[run_id]
        v2_load(layout, run_id, pairs_table(pairs), baselines, v2_effects(rows), recorded)
    n_rows = len(runs["atp"][2]) + len(runs["knockout"][2])
    assert query(wh, "SELECT count(*) FROM effects")[1] == [(n_rows,)]
    said = capsys.readouterr().err
    assert f"migrated from schema v2 to v3 (2 runs, {n_rows:,} effect rows filed by row shape)" in said
    assert layout.version() == SCHEMA_VERSION == 3
    con = duckdb.connect(str(wh), read_only=True)  # the dashboard file: today's views, of every shape
    try:
        assert con.execute("SELECT schema FROM patchgrid_catalog").fetchone() == (3,)
        assert con.execute("SELECT DISTINCT row_shape FROM effects ORDER BY 1").fetchall() == [
            ("estimate",), ("exact",), ("knockout",), ("noised",)]
    finally:
        con.close()
    assert [len(layout.loads(r)) for r in ("atp", "knockout")] == [2, 2]  # the v2 load stays while read
    connect(wh).close()
    assert "migrated" not in capsys.readouterr().err  # once


def test_every_view_of_a_migrated_run_is_the_same_rows_loaded_today(warehouses, runs):
    migrated, loaded = (connect(wh) for wh in warehouses)  # a snapshot each, every view
    try:
        views = [v for (v,) in migrated.execute(
            "SELECT table_name FROM information_schema.columns WHERE column_name = 'run_id' "
            "AND table_name NOT IN ('runs', 'run_overview', 'published') ORDER BY 1").fetchall()]
        assert {"effects", "effect_summary_facts", "trace_buckets", "atp_agreement", "edge_summary", "circuit_score",
                "knockout_curve", "path_summary", "sweep_kinds", "noised_sweeps"} <= set(views)
        for view in views:
            sql = f"SELECT * FROM {view} ORDER BY ALL"
            old, today = migrated.execute(sql).fetchall(), loaded.execute(sql).fetchall()
            assert len(old) == len(today), view
            assert old or view not in {"effects", "effect_summary", "trace_buckets", "atp_summary", "path_summary",
                                       "edge_summary", "circuit_curve", "knockout_curve"}, view
            for o, t in zip(old, today):
                assert list(o) == [pytest.approx(v, rel=1e-12) if isinstance(v, float) else v for v in t], view
        sql = "SELECT * FROM atp_exact_sweeps ORDER BY ALL"
        assert migrated.execute(sql).fetchall() == loaded.execute(sql).fetchall()
    finally:
        migrated.close()
        loaded.close()


def test_the_migrated_rows_say_their_shape_and_a_knockout_says_it_is_one(warehouses):
    old, _ = warehouses
    got = query(old, "SELECT sweep, row_shape, direction, site FROM effects WHERE run_id = 'every-kind' AND sweep "
                     "IN ('knockout', 'trace', 'edges', 'circuit', 'paths', 'atp') GROUP BY ALL ORDER BY ALL")[1]
    assert {(s, shape) for s, shape, *_ in got} == {
        ("atp", "estimate"), ("circuit", "circuit"), ("edges", "edge"), ("knockout", "knockout"), ("paths", "path"),
        ("trace", "noised")}
    assert [(d, site) for s, _, d, site in got if s == "knockout"] == [("knockout", "attention_edges")]
    # the loads that recorded no kinds: their sweep on p is noised, as v2 took it
    assert query(old, "SELECT run_id, sweep FROM noised_sweeps WHERE run_id LIKE '%record' ORDER BY ALL")[1] == [
        ("empty-record", "trace"), ("no-record", "trace")]
    layout = Layout.of(old)
    files = sorted(f.parent.name for f in (layout.loads("every-kind")[-1] / "effects").glob("*/*.parquet"))
    assert files == [f"row_shape={s}" for s in ("circuit", "edge", "estimate", "exact", "knockout", "noised", "path")]
