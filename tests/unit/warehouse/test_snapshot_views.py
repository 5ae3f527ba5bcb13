"""A query's snapshot holds the summary views its SQL reads and those they read, not all of them
(catalog.summary_statements_for): each view is bound as it is created, and the whole stack cost
most of a query's time. What a query returns, and how it fails, is as with every view."""
from __future__ import annotations

import re

import pytest

from patchgrid.warehouse.catalog import open_snapshot, summary_statements, summary_statements_for
from patchgrid.warehouse.layout import Layout
from patchgrid.warehouse.loader import WarehouseError, connect, query
from tests.unit.warehouse.test_loader import load

NAMES = [name for name, _, _ in summary_statements()]


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("snapshot")
    wh = tmp / "w.duckdb"
    load(tmp, wh)
    return wh


def _created(con) -> set[str]:
    return {r[0].lower() for r in con.execute(
        "SELECT view_name FROM duckdb_views() WHERE NOT internal UNION SELECT table_name FROM duckdb_tables() UNION "
        "SELECT function_name FROM duckdb_functions() WHERE function_type LIKE '%macro%' AND NOT internal").fetchall()}


def _reads(name: str) -> set[str]:
    """`name` and every summary view or macro it reads, through the views it reads: from the statements
    themselves, written out again here."""
    reads = {n: needs for n, _, needs in summary_statements()}
    out, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += reads[n]
    return out


def test_the_statements_are_every_summary_view_and_macro_once():
    assert len(NAMES) == len(set(NAMES)) >= 30
    assert {"effect_summary", "t975", "circuit_score", "atp_agreement", "run_overview", "metrics"} <= set(NAMES)
    assert len(summary_statements_for(None)) == len(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_query_naming_a_view_gets_it_and_what_it_reads_and_nothing_else(warehouse, name):
    """Opening binds every view it creates: a dependency left out fails the opening itself."""
    con = open_snapshot(Layout.of(warehouse), f"SELECT * FROM {name}")
    try:
        created = _created(con)
    finally:
        con.close()
    assert created & set(NAMES) == _reads(name)
    assert {"published", "runs", "pairs", "baselines", "effects", "sweep_kinds"} <= created  # the base, always


def test_a_query_of_the_base_views_binds_no_summary(warehouse):
    assert summary_statements_for("SELECT count(*) FROM effects WHERE sweep = 'resid'") == []
    assert query(warehouse, "SELECT count(*) FROM effects")[1][0][0] > 0


@pytest.mark.parametrize("sql", [
    "SELECT * FROM effect_summary ORDER BY ALL",
    "SELECT * FROM EFFECT_SUMMARY ORDER BY ALL",  # names are case-blind
    'SELECT * FROM "effect_summary" ORDER BY ALL',
    "SELECT * FROM query_table('effect_' || 'summary') ORDER BY ALL",  # named by no word: asked again with all
])
def test_a_query_returns_what_it_returns_with_every_view(warehouse, sql):
    full = connect(warehouse)
    try:
        want = full.execute("SELECT * FROM effect_summary ORDER BY ALL").fetchall()
    finally:
        full.close()
    got = query(warehouse, sql)[1]
    assert want and len(got) == len(want)
    for a, b in zip(got, want):  # DuckDB's parallel sums may round their last bit either way
        assert list(a) == [pytest.approx(y, rel=1e-12, abs=1e-12) if isinstance(y, float) else y for y in b]


@pytest.mark.parametrize("sql", ["SHOW TABLES", "SHOW ALL TABLES", "DESCRIBE",
                                 "SELECT table_name FROM information_schema.tables",
                                 "SELECT view_name FROM duckdb_views()"])
def test_a_query_of_the_catalog_sees_every_view(warehouse, sql):
    got = {str(c).lower() for row in query(warehouse, sql)[1] for c in row}
    views = {name for name, text, _ in summary_statements()
             if re.search(r"CREATE\s+(OR\s+REPLACE\s+)?VIEW", re.sub(r"--[^\n]*", "", text), re.IGNORECASE)}
    assert len(views) >= 25
    assert views <= got, views - got


def test_a_misspelt_view_is_suggested_from_every_view(warehouse):
    with pytest.raises(WarehouseError, match='Did you mean "circuit_score"') as failed:
        query(warehouse, "SELECT * FROM circuit_scor")
    assert failed.value.__cause__ is not None
