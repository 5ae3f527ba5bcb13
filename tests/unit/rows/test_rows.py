"""One definition per row shape: the warehouse declares exactly the Arrow schemas' columns, and
closed columns refuse values outside their sets wherever rows are written."""
from __future__ import annotations

import pytest

from patchgrid.metrics import METRICS
from patchgrid.model.sites import SITE_KINDS
from patchgrid.pairs import to_table as pairs_table
from patchgrid.rows.effects import to_table as effects_table
from patchgrid.rows.effects import write_effects
from patchgrid.rows.shapes import (
    BASE_RUNS,
    DIRECTIONS,
    EFFECT,
    KNOCKOUT_DIRECTION,
    KNOCKOUT_SITE,
    PAIR,
    SWEEP_NAMES,
    WAREHOUSE_TABLES,
    RowError,
    sql_type,
)
from patchgrid.sweeps import SWEEP_KINDS
from patchgrid.warehouse.loader import connect, ensure, load_run, start_run


def warehouse_columns(table: str) -> list[tuple[str, str]]:
    """(column, DuckDB type) in order, as the warehouse table must declare them."""
    cols = [(f.name, sql_type(f)) for f in WAREHOUSE_TABLES[table].schema]
    return cols if table == "runs" else [("run_id", "VARCHAR")] + cols


def test_warehouse_tables_declare_exactly_the_row_shapes(tmp_path):
    """Both ways of reading: patchgrid's snapshot connection and the file dashboards open."""
    import duckdb

    ensure(tmp_path / "w.duckdb")
    for con in (connect(tmp_path / "w.duckdb"), duckdb.connect(str(tmp_path / "w.duckdb"), read_only=True)):
        try:
            for table in WAREHOUSE_TABLES:
                declared = con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                       "WHERE table_name = ? ORDER BY ordinal_position", [table]).fetchall()
                assert declared == warehouse_columns(table), table
        finally:
            con.close()


def effect(**change):
    row = {"pair_id": "p", "relation": "r", "sweep": "resid", "site": "resid", "direction": "denoise", "layer": 0,
           "position": 1, "position_role": "subject_last", "metric": "logit_diff", "patched_logit_diff": 1.0,
           "recovery": 0.5}
    row.update(change)
    return row


def test_closed_sets_are_the_registries():
    assert EFFECT.closed["sweep"] == SWEEP_NAMES == tuple(SWEEP_KINDS)  # every kind registered, in order
    assert EFFECT.closed["site"] == SITE_KINDS + (KNOCKOUT_SITE,)  # a knockout's rows name what they are
    assert EFFECT.closed["direction"] == tuple(BASE_RUNS) == DIRECTIONS + (KNOCKOUT_DIRECTION,)
    assert EFFECT.closed["metric"] == tuple(METRICS)


@pytest.mark.parametrize("column, value", [("sweep", "everything"), ("site", "mlp_in"), ("direction", "sideways"),
                                           ("metric", "logprob"), ("position_role", "middle")])
def test_effect_rows_outside_their_sets_are_refused(tmp_path, column, value):
    with pytest.raises(RowError, match=f"effect rows: {column} '{value}' is not one of"):
        effects_table([effect(), effect(**{column: value})])
    with pytest.raises(RowError, match=column):
        write_effects([effect(**{column: value})], tmp_path / "e.parquet")
    assert not (tmp_path / "e.parquet").exists()


def test_pair_rows_outside_their_sets_are_refused():
    pairs_table([{"pair_id": "a", "status": "rejected", "reason": "no_partner"}])
    with pytest.raises(RowError, match="pair rows: status 'maybe'"):
        pairs_table([{"pair_id": "a", "status": "maybe"}])
    with pytest.raises(RowError, match="pair rows: reason 'bad_luck'"):
        pairs_table([{"pair_id": "a", "status": "rejected", "reason": "bad_luck"}])


def test_the_loader_refuses_a_staged_file_outside_the_sets(tmp_path):
    """A file written by other means than patchgrid's writers is checked before it is loaded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    wh = tmp_path / "w.duckdb"
    good = EFFECT.table([effect()])
    bad = good.set_column(good.schema.get_field_index("site"), "site", pa.array(["nowhere"]))
    pq.write_table(bad, tmp_path / "bad.parquet")
    start_run(wh, {"run_id": "r", "model": "m"})
    pairs = PAIR.table([{"pair_id": "p", "status": "accepted"}])
    with pytest.raises(RowError, match="effect rows: site 'nowhere'"):
        load_run(wh, "r", pairs, [{"pair_id": "p"}], [tmp_path / "bad.parquet"])
    con = connect(wh)
    assert con.execute("SELECT count(*) FROM effects").fetchone()[0] == 0
    con.close()


def test_a_key_outside_the_shape_is_refused():
    with pytest.raises(RowError, match="effect rows: 'recovry' is not a column"):
        effects_table([effect(recovry=0.5)])
