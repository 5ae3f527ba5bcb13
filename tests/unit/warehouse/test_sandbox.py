"""A query reads the warehouse and nothing else: no file read or written through SQL."""
from __future__ import annotations

import pytest

from patchgrid.warehouse.layout import Layout
from patchgrid.warehouse.loader import WarehouseError, connect, query
from tests.unit.warehouse.test_loader import load


@pytest.mark.parametrize("sql", [
    "COPY (SELECT 42) TO '{tmp}/x.csv'",
    "COPY (SELECT 42) TO '{data}/runs/x.parquet'",  # not even into the warehouse's own folder
    "SELECT 1; COPY (SELECT 42) TO '{tmp}/x.csv'",
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM glob('/etc/*')",
    "ATTACH '{tmp}/other.duckdb'",
    "EXPORT DATABASE '{tmp}/export'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "RESET enable_external_access",
])
def test_a_query_cannot_touch_the_file_system(tmp_path, sql):
    wh = tmp_path / "w.duckdb"
    load(tmp_path, wh)
    data = Layout.of(wh).data
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(WarehouseError, match="query (refused|failed): .*(disabled (by|through) configuration|locked"
                                             "|read-only to queries)"):
        query(wh, sql.format(tmp=tmp_path, data=data))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_report_connection_is_sandboxed_too(tmp_path):
    import duckdb

    wh = tmp_path / "w.duckdb"
    load(tmp_path, wh)
    con = connect(wh)  # what the report reads through
    try:
        assert con.execute("SELECT count(*) FROM effect_summary").fetchone()[0] > 0
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"COPY (SELECT 1) TO '{tmp_path}/y.csv'")
    finally:
        con.close()
    # the JSON parameters of a run still read
    assert query(wh, "SELECT params->>'x' FROM runs")[1] == [("1",)]


@pytest.mark.parametrize("sql, hint", [
    ("SELECT * FROM effect_summar", 'Did you mean "effect_summary"?'),
    ("SELECT nope FROM runs", "Candidate bindings:"),
])
def test_a_failed_query_keeps_duckdbs_hint_on_one_line(tmp_path, sql, hint):
    wh = tmp_path / "w.duckdb"
    load(tmp_path, wh)
    with pytest.raises(WarehouseError, match="query failed") as failed:
        query(wh, sql)
    message = str(failed.value)
    assert hint in message and "\n" not in message, message
    assert failed.value.__cause__ is not None  # DuckDB's own error, kept
