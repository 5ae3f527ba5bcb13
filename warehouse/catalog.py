"""The warehouse's views over its Parquet files: the same SQL for the DuckDB file dashboards open
and for the in-memory connection patchgrid's own queries and report read through.

Base views (`runs`, `pairs`, `baselines`, `effects`) are generated from the row shapes in
patchgrid/rows/shapes.py: `run_id`, then exactly the shape's columns and types (`effects`: every row
shape's files at once, each row with its `row_shape`); `sweep_kinds` (each load's record of the shape
of each sweep's rows) from kinds.py. The views select effect rows by their `row_shape`. `metrics` and
`effect_metrics` (the effect rows, one per metric) are generated from patchgrid/metrics.py; the
summaries on top of them are `views.sql`. `published` lists each run's current load (its
latest); every data view reads only published loads, so a load being written, or one
superseded, is never read.

patchgrid's own connections take a snapshot when they open (`published` and `runs` are copied into
the connection), so every query on one connection sees the same set of loads, however many land
meanwhile. A query's snapshot creates only the summary views its SQL reads (summary_statements_for).
The dashboard file cannot hold a snapshot (it is opened read-only): each of its queries lists the
loads afresh.
"""
from __future__ import annotations

import hashlib
import os
import re
from functools import cache
from importlib import resources
from pathlib import Path

from patchgrid.metrics import METRICS
from patchgrid.rows.shapes import BASE_RUNS, EFFECT, ROW_SHAPES, WAREHOUSE_TABLES, sql_type

from .kinds import SWEEP_KIND
from .layout import SCHEMA_VERSION, TMP_PREFIX, Layout, stamp

# Neither loads an extension behind the user's back; both hold for every connection opened here.
BASE_CONFIG = {"autoload_known_extensions": False, "autoinstall_known_extensions": False}


def _hive(*keys: str) -> str:
    """read_parquet's options for files under the folders `key=value/` of `keys`."""
    types = ", ".join(f"'{key}': 'VARCHAR'" for key in keys)
    return f"hive_partitioning = true, hive_types = {{{types}}}, union_by_name = true"


# What each base view's files are partitioned by (layout.Layout.glob; effects: kinds.shape_folder)
PARTITIONS = {"pairs": ("run_id", "load"), "baselines": ("run_id", "load"), "sweep_kinds": ("run_id", "load"),
              "effects": ("run_id", "load", "row_shape")}


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _columns(table: str, alias: str) -> str:
    shape = WAREHOUSE_TABLES[table]
    cols = [f"{alias}.{_q(f.name)}::{sql_type(f)} AS {_q(f.name)}" for f in shape.schema]
    return ", ".join(cols if table == "runs" else [f"{alias}.run_id::VARCHAR AS run_id", *cols])


def _published(layout: Layout, table: str, columns: str) -> str:
    """SQL creating the view `table` of the published loads' files of it."""
    # the published load is bound first: a load that lands meanwhile is filtered out, not half read
    return (f"CREATE OR REPLACE VIEW {table} AS SELECT {columns} FROM published p "
            f"JOIN read_parquet({_lit(layout.glob(table))}, {_hive(*PARTITIONS[table])}) t "
            f"ON t.run_id = p.run_id AND t.load = p.load")


def base_view_statements(layout: Layout, snapshot: bool) -> list[str]:
    """SQL creating `published`, `runs`, `pairs`, `baselines`, `effects` and `sweep_kinds` (tables
    for the first two when `snapshot`)."""
    kind = "TABLE" if snapshot else "VIEW"
    status_files = f"read_parquet({_lit(layout.glob('status'))}, filename = true, union_by_name = true)"
    # a load folder is published when its pairs file is there (the folder appears whole)
    loads = (f"SELECT m.run_id AS run_id, max(m.load) AS load FROM (SELECT regexp_extract(file, "
             f"'/run_id=([^/]+)/load=([^/]+)/pairs\\.parquet$', ['run_id', 'load']) AS m "
             f"FROM glob({_lit(layout.glob('pairs'))})) GROUP BY m.run_id")
    statements = [
        f"CREATE OR REPLACE {kind} published AS {loads}",
        f"CREATE OR REPLACE {kind} runs AS SELECT {_columns('runs', 's')} FROM (SELECT *, row_number() OVER "
        f"(PARTITION BY run_id ORDER BY filename DESC) AS state_rank FROM {status_files}) s WHERE s.state_rank = 1",
    ]
    statements += [_published(layout, table, _columns(table, "t")) for table in ("pairs", "baselines", "effects")]
    kinds = ", ".join(f"t.{_q(f.name)}::{sql_type(f)} AS {_q(f.name)}" for f in SWEEP_KIND.schema)
    statements.append(_published(layout, "sweep_kinds", f"t.run_id::VARCHAR AS run_id, {kinds}"))
    return statements


# What identifies an effect row: the columns of rows.EFFECT before its headline `metric`.
IDENTITY = tuple(EFFECT.columns[:EFFECT.columns.index("metric")])
# A pair's cell: its rows at the positions of one role are averaged into one (a pair may have
# several `further` positions).
PAIR_CELL = tuple(c for c in IDENTITY if c != "position")
# The shapes whose rows the effect views average (effect_metrics, pair_effects and the summaries on
# them): one patched run per row, its effect its own (kinds.py). An estimate or an edge was patched
# exactly only when its score ranked high or it was sampled, so its exact effects are a selected
# subset (atp_summary, atp_agreement, edge_summary read them); a circuit's and a knockout's rows have
# views of their own (the effect views would average a knockout's groups together).
EFFECT_VIEW_SHAPES = ("exact", "path", "noised")


def shape_is(*shapes: str) -> str:
    """SQL selecting the effect rows of `shapes`."""
    unknown = [s for s in shapes if s not in ROW_SHAPES]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a row shape (rows.shapes.EFFECT_SHAPES)")
    return f"row_shape = {_lit(shapes[0])}" if len(shapes) == 1 else f"row_shape IN ({', '.join(map(_lit, shapes))})"


def _measures(name: str, metric) -> dict[str, str]:
    """SQL for one metric's measures of an effect row: its three readings, the effect (measured
    from the run the patch is written into: effects.effect_row's rule), the recovery where the
    metric has one, and moved and span, which a ratio of means over pairs takes. Readings are
    widened to DOUBLE before subtracting, so differences of float32 values lose nothing more."""
    pat, cln, cor = (f"{prefix}_{name}::DOUBLE" for prefix in ("patched", "clean", "corrupt"))
    recovery = "NULL::DOUBLE" if metric.min_span is None else \
        f"CASE WHEN {cln} <> {cor} THEN ({pat} - {cor}) / ({cln} - {cor}) END"
    from_clean = ", ".join(_lit(d) for d, run in BASE_RUNS.items() if run == "clean")
    return {"patched": pat, "clean": cln, "corrupt": cor,
            "effect": f"{pat} - CASE WHEN direction IN ({from_clean}) THEN {cln} ELSE {cor} END",
            "recovery": recovery, "moved": f"{pat} - {cor}", "span": f"{cln} - {cor}"}


def metric_statements() -> list[str]:
    """`metrics` (each metric, what it is, its direction and the smallest span a recovery divides
    by; NULL: no recovery), `effect_metrics` (the effect rows in long form) and `pair_effects`
    (each pair's rows of one cell averaged, per metric), all generated from patchgrid/metrics.py,
    so a metric added there reaches every view without SQL written by hand.

    A row that has no value on a metric (logit_diff of a multi-token answer; every metric but
    logit_diff and p in a load written before they existed, read as NULL) is no row of that metric.
    These views hold the rows of EFFECT_VIEW_SHAPES; each other shape has views of its own.
    """
    def span(m):
        return "NULL::DOUBLE" if m.min_span is None else repr(float(m.min_span))

    rows = ", ".join(f"({_lit(name)}, {_lit(m.meaning)}, {int(m.better)}, {span(m)})" for name, m in METRICS.items())
    ident = ", ".join(_q(c) for c in IDENTITY)
    exact = shape_is(*EFFECT_VIEW_SHAPES)
    measures = {name: _measures(name, m) for name, m in METRICS.items()}
    # One branch per metric: a filter on `metric` prunes the other branches' Parquet columns unread.
    long = " UNION ALL ".join(
        f"SELECT run_id, {ident}, {_lit(name)} AS metric, "
        + ", ".join(f"{sql} AS {col}" for col, sql in ms.items())
        + f" FROM effects WHERE patched_{name} IS NOT NULL AND {exact}" for name, ms in measures.items())
    # pair_effects averages the wide rows first, every metric in one pass over the effect rows,
    # and only then makes one row per metric: a run's millions of effect rows are read once, not
    # once per metric.
    cell = ", ".join(_q(c) for c in PAIR_CELL)
    aggregates = ", ".join(
        f"count(patched_{name}) AS n_{name}, "
        + ", ".join(f"avg({ms[col]}) AS {col}_{name}" for col in ("effect", "recovery", "moved", "span"))
        for name, ms in measures.items())
    per_metric = " UNION ALL ".join(
        f"SELECT run_id, {cell}, {_lit(name)} AS metric, n_{name} AS n_positions, "
        + ", ".join(f"{col}_{name} AS {col}" for col in ("effect", "recovery", "moved", "span"))
        + f" FROM wide WHERE n_{name} > 0" for name in METRICS)
    pair_effects = (f"WITH wide AS MATERIALIZED (SELECT run_id, {cell}, {aggregates} FROM effects WHERE {exact} "
                    f"GROUP BY ALL) "
                    f"{per_metric}")
    # The estimated rows with the span clean - corrupt of their own metric (attribution patching's
    # agreement judges a pair's importance threshold by it, as pair_effects_judged does recoveries).
    span = " ".join(f"WHEN {_lit(name)} THEN {ms['span']}" for name, ms in measures.items())
    value = " ".join(f"WHEN {_lit(name)} THEN {ms['patched']}" for name, ms in measures.items())
    full = " ".join(f"WHEN {_lit(name)} THEN {ms['clean']}" for name, ms in measures.items())
    # The knockout rows in long form, one row per metric: the knocked-out run's reading and the clean run's.
    knockouts = " UNION ALL ".join(
        f"SELECT run_id, pair_id, relation, blocked, layer, \"window\", {_lit(name)} AS metric, metric = {_lit(name)} "
        f"AS headline, {ms['patched']} AS value, {ms['clean']} AS clean_value FROM effects "
        f"WHERE {shape_is('knockout')} AND patched_{name} IS NOT NULL" for name, ms in measures.items())
    rows_of = "SELECT * EXCLUDE (row_shape)"  # the rows of one shape
    return [f"CREATE OR REPLACE VIEW metrics AS SELECT * FROM (VALUES {rows}) t(metric, meaning, better, min_span)",
            f"CREATE OR REPLACE VIEW effect_metrics AS {long}",
            f"CREATE OR REPLACE VIEW pair_effects AS {pair_effects}",
            f"CREATE OR REPLACE VIEW atp_effects AS {rows_of}, CASE metric {span} END AS span "
            f"FROM effects WHERE {shape_is('estimate')}",
            f"CREATE OR REPLACE VIEW edge_effects AS {rows_of}, CASE metric {span} END AS span "
            f"FROM effects WHERE {shape_is('edge')}",
            f"CREATE OR REPLACE VIEW circuit_effects AS {rows_of}, CASE metric {value} END AS value, "
            f"CASE metric {full} END AS full_value FROM effects WHERE {shape_is('circuit')}",
            f"CREATE OR REPLACE VIEW knockout_effects AS {knockouts}"]


def summary_view_sql() -> str:
    text = resources.files("patchgrid.warehouse").joinpath("views.sql").read_text()
    return ";\n".join(metric_statements()) + ";\n" + text


def views_fingerprint(layout: Layout) -> str:
    text = "\n".join(base_view_statements(layout, snapshot=False)) + summary_view_sql()
    return hashlib.sha256(f"{SCHEMA_VERSION}\n{text}".encode()).hexdigest()[:16]


def write_catalog(layout: Layout) -> None:
    """The dashboard file: views only, written whole under a temporary name and renamed over the
    old one (a dashboard holding the old one open keeps reading it)."""
    import duckdb

    tmp = layout.catalog.with_name(f"{TMP_PREFIX}{layout.catalog.name}-{stamp()}")
    try:
        con = duckdb.connect(str(tmp), config=BASE_CONFIG)
        try:
            for sql in base_view_statements(layout, snapshot=False):
                con.execute(sql)
            con.execute(summary_view_sql())
            con.execute("CREATE TABLE patchgrid_catalog (schema INTEGER, data VARCHAR, views VARCHAR)")
            con.execute("INSERT INTO patchgrid_catalog VALUES (?, ?, ?)",
                        [SCHEMA_VERSION, str(layout.data.resolve()), views_fingerprint(layout)])
            con.execute("CHECKPOINT")
        finally:
            con.close()
        os.replace(tmp, layout.catalog)
    finally:
        tmp.unlink(missing_ok=True)
        Path(str(tmp) + ".wal").unlink(missing_ok=True)


def catalog_is_current(layout: Layout, recorded: tuple | None) -> bool:
    return recorded is not None and tuple(recorded) == (SCHEMA_VERSION, str(layout.data.resolve()),
                                                        views_fingerprint(layout))


# The name a summary statement creates (views.sql: views and macros)
_CREATES = re.compile(r"\bCREATE\s+(?:OR\s+REPLACE\s+)?(?:TEMP(?:ORARY)?\s+)?(?:VIEW|MACRO|FUNCTION|TABLE)\s+"
                      r"(?:IF\s+NOT\s+EXISTS\s+)?\"?(\w+)", re.IGNORECASE)
# SQL that reads the catalog itself (SHOW TABLES, DESCRIBE, information_schema, duckdb_views() ...): it is
# shown every view
_READS_CATALOG = re.compile(r"information_schema|\bduckdb_\w+|pg_catalog|sqlite_master|\bpragma\b|\bshow\b|"
                            r"\bdescribe\b", re.IGNORECASE)


def _without_comments(sql: str) -> str:
    return re.sub(r"--[^\n]*", "", sql)


@cache
def summary_statements() -> tuple[tuple[str, str, frozenset], ...]:
    """The summary views and macros (summary_view_sql), one statement each in creation order: (the
    name it creates, its SQL, the names of the others it reads)."""
    import duckdb

    parsed = [(_CREATES.search(_without_comments(st.query)).group(1).lower(), st.query)
              for st in duckdb.extract_statements(summary_view_sql())]
    named = _names_pattern([name for name, _ in parsed])
    return tuple((name, sql, frozenset(named.findall(_without_comments(sql).lower())) - {name})
                 for name, sql in parsed)


def _names_pattern(names: list[str]) -> re.Pattern:
    """Any of `names` as a whole word, in any case."""
    return re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b", re.IGNORECASE)


@cache
def _summary_names() -> re.Pattern:
    return _names_pattern([name for name, _, _ in summary_statements()])


def summary_statements_for(sql: str | None) -> list[str]:
    """The summary statements a query needs: those creating the views and macros its text names, and
    those they read, in creation order; every one for no query or one that reads the catalog itself.
    (Each view is bound as it is created, and binding the whole stack of them costs most of a
    snapshot's opening: half a second here, more as a warehouse's files grow.)"""
    statements = summary_statements()
    if sql is None or _READS_CATALOG.search(sql):
        return [text for _, text, _ in statements]
    reads = {name: needs for name, _, needs in statements}
    wanted = {name.lower() for name in _summary_names().findall(_without_comments(sql))}
    todo = list(wanted)
    while todo:
        for name in reads[todo.pop()] - wanted:
            wanted.add(name)
            todo.append(name)
    return [text for name, text, _ in statements if name in wanted]


def open_snapshot(layout: Layout, query: str | None = None):
    """An in-memory connection whose views read the warehouse's files and nothing else: no other
    file is read or written through SQL, no extension is loaded, and the settings are locked. With
    `query` (its SQL), of the summary views only those it reads (summary_statements_for)."""
    import duckdb

    con = duckdb.connect(":memory:", config=BASE_CONFIG)
    try:
        con.execute("SET allowed_directories = ?", [[str(layout.data.resolve()) + os.sep]])
        for sql in base_view_statements(layout, snapshot=True) + summary_statements_for(query):
            con.execute(sql)
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except Exception:
        con.close()
        raise
    return con
