"""Write runs into the warehouse, and open it for reading.

Writers never wait for readers or for each other (see layout.py): a run's state is a new status
file per change, a run's rows are a new load folder renamed into place whole, so a study can load
while any number of dashboards and queries hold the warehouse open, and studies on many machines
can load into one shared folder at once. Loads are idempotent: a rerun's load replaces its run's
rows. A load that dies half-way leaves the warehouse as it was.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from patchgrid.rows.shapes import (
    BASELINE,
    EFFECT,
    EFFECT_SHAPES,
    PAIR,
    PAIR_IN_WAREHOUSE,
    RUN,
    RUN_STATUSES,
    RowError,
)

from .catalog import BASE_CONFIG, catalog_is_current, open_snapshot, write_catalog
from .kinds import BATCH_ROWS, SWEEP_KIND, ShapedEffects, empty_effects, shapes_by_sweep
from .layout import EMPTY_RUN, SCHEMA_VERSION, Layout, publish_dir, publish_file, remove_superseded, stamp

__all__ = ["SCHEMA_VERSION", "WarehouseError", "check_writable", "connect", "ensure", "finish_run", "load_run",
           "query", "start_run"]

# Statements a query may run: reading only (SHOW, DESCRIBE, SUMMARIZE, WITH and VALUES are SELECTs).
QUERY_STATEMENTS = {"SELECT"}


class WarehouseError(ValueError):
    """A warehouse that cannot be used; the message names the file and the problem."""


def _identify(path: Path) -> tuple[str, tuple | None]:
    """What the DuckDB file at `path` is, with what a view file records of itself:
    ('catalog', (schema, data folder, views fingerprint)) for views over a data folder, ('v1', None)
    for a schema-1 warehouse (tables in one DuckDB file); raises for anything else."""
    import duckdb

    if path.is_dir():
        raise WarehouseError(f"warehouse {path} is a folder, not a DuckDB file")
    if path.stat().st_size > 0:
        with open(path, "rb") as f:
            head = f.read(16)
        if head[8:12] != b"DUCK":
            raise WarehouseError(f"warehouse {path} is not a DuckDB file")
    try:
        # no config of our own: a process that holds the file open (a notebook's dashboard
        # connection) can still be asked, which a connection with other settings could not
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as exc:
        raise WarehouseError(f"warehouse {path} cannot be opened: {str(exc).strip().splitlines()[0]}") from None
    try:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "patchgrid_catalog" in tables:
            return "catalog", con.execute("SELECT schema, data, views FROM patchgrid_catalog").fetchone()
        if "patchgrid_schema" in tables:
            version = con.execute("SELECT max(version) FROM patchgrid_schema").fetchone()[0]
            if version == 1:
                return "v1", None
            raise WarehouseError(f"warehouse {path} has schema v{version}, which this patchgrid does not know")
        raise WarehouseError(f"warehouse {path} is a DuckDB file but not a patchgrid warehouse")
    except duckdb.Error as exc:
        raise WarehouseError(f"warehouse {path} cannot be read: {str(exc).strip().splitlines()[0]}") from None
    finally:
        con.close()


def _check_version(layout: Layout) -> bool:
    """Refuse a data folder of a newer schema; migrate one of an older (migrate.py). Returns whether
    it was migrated."""
    try:
        version = layout.version()
    except ValueError as exc:
        raise WarehouseError(f"warehouse {layout.catalog}: {exc}") from None
    if version > SCHEMA_VERSION:
        raise WarehouseError(f"warehouse {layout.catalog} is from a newer patchgrid (schema v{version}; this one "
                             f"knows v{SCHEMA_VERSION}): upgrade patchgrid")
    if version == SCHEMA_VERSION:
        return False
    from .migrate import migrate_v2

    try:
        print(migrate_v2(layout), file=sys.stderr)
    except OSError as exc:
        raise WarehouseError(f"warehouse {layout.catalog} has schema v{version}: the first patchgrid that can write "
                             f"it migrates it to v{SCHEMA_VERSION}, and this one cannot ({exc})") from None
    return True


def _shapes_fingerprint() -> str:
    import hashlib

    shapes = (PAIR_IN_WAREHOUSE, BASELINE, EFFECT, *EFFECT_SHAPES.values(), RUN, SWEEP_KIND)
    text = "|".join(f"{shape.name}: {shape.schema}" for shape in shapes)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _empty_load(folder: Path) -> None:
    pq.write_table(PAIR_IN_WAREHOUSE.table([]), folder / "pairs.parquet")
    pq.write_table(BASELINE.table([]), folder / "baselines.parquet")
    empty_effects(folder / "effects")
    pq.write_table(SWEEP_KIND.table([]), folder / "sweep_kinds.parquet")


def _check_files(layout: Layout) -> tuple[str | None, tuple | None]:
    """What the warehouse's DuckDB file is (None: there is none), refusing one that cannot be written."""
    catalog = layout.catalog
    _existing_folder(layout)
    kind, recorded = _identify(catalog) if catalog.exists() else (None, None)
    if catalog.exists() and not catalog.stat().st_mode & 0o222:
        # honoured even for root, who could write anyway: the user marked it read-only
        raise WarehouseError(f"warehouse {catalog} is read-only (its file mode allows no writing)")
    if layout.data.exists() and not layout.data.is_dir():
        raise WarehouseError(f"warehouse {catalog}: {layout.data} is a file, not the warehouse's data folder")
    return kind, recorded


def _create_or_check(layout: Layout, kind: str | None) -> None:
    """The data folder there and of a schema this patchgrid knows: created when missing, migrated from v1."""
    if kind == "v1":
        from .migrate import migrate_v1

        print(migrate_v1(layout), file=sys.stderr)
    if layout.exists():
        _check_version(layout)
    else:
        try:
            layout.catalog.parent.mkdir(parents=True, exist_ok=True)  # a missing folder is made, not refused
            layout.data.mkdir(exist_ok=True)
        except OSError as exc:
            raise WarehouseError(f"warehouse {layout.catalog}: cannot create {layout.data} ({exc.strerror})") from None
        publish_file(lambda tmp: tmp.write_text(json.dumps({"schema": SCHEMA_VERSION}) + "\n"), layout.version_file)
    if not os.access(layout.data, os.W_OK):
        raise WarehouseError(f"warehouse {layout.catalog} is read-only ({layout.data} cannot be written)")


def _ensure_empty_files(layout: Layout) -> None:
    """Empty files in today's shapes: every glob matches a file, and every column of the shapes is
    in one (loads written before a column was added read it as NULL)."""
    empty = f"load=0-{_shapes_fingerprint()}"
    if not (layout.run_dir(EMPTY_RUN) / empty).is_dir():
        try:
            publish_dir(_empty_load, layout.run_dir(EMPTY_RUN), empty)
        except OSError:
            if not (layout.run_dir(EMPTY_RUN) / empty).is_dir():  # not another process creating it
                raise
    status = layout.status_dir(EMPTY_RUN) / f"0-{_shapes_fingerprint()}.parquet"
    if not status.exists():
        publish_file(lambda tmp: pq.write_table(RUN.table([]), tmp), status)


def ensure(path: str | Path) -> Layout:
    """The warehouse at `path`, ready to be written: created when missing, migrated from schema
    v1, its dashboard file rewritten when its views are out of date."""
    layout = Layout.of(path)
    kind, recorded = _check_files(layout)
    _create_or_check(layout, kind)
    _ensure_empty_files(layout)
    if kind != "catalog" or not catalog_is_current(layout, recorded):
        write_catalog(layout)
    return layout


def _existing_folder(layout: Layout) -> Path:
    """The warehouse's folder, or the nearest one above it that exists (its first write makes the
    rest); refused when that is a file."""
    folder = next(p for p in layout.catalog.parents if p.exists() or p == p.parent)
    if not folder.is_dir():
        raise WarehouseError(f"warehouse {layout.catalog}: {folder} is a file, not a folder")
    return folder


def check_writable(path: str | Path) -> None:
    """Fail early, before a study runs, on a warehouse it could not load into; one that is not there
    yet is checked and left unmade (its first write makes it, and any folder it needs), so that a
    command failing later leaves no warehouse behind."""
    layout = Layout.of(path)
    if layout.catalog.exists() or layout.data.exists():
        ensure(path)
    elif not os.access(folder := _existing_folder(layout), os.W_OK):
        raise WarehouseError(f"warehouse {layout.catalog}: folder {folder} cannot be written")


def _latest_state(layout: Layout, run_id: str) -> dict | None:
    files = sorted(layout.status_dir(run_id).glob("*.parquet")) if layout.status_dir(run_id).is_dir() else []
    if not files:
        return None
    rows = pq.read_table(files[-1]).to_pylist()
    return rows[0] if rows else None


def _write_state(layout: Layout, row: dict) -> None:
    table = RUN.table([row])
    publish_file(lambda tmp: pq.write_table(table, tmp), layout.status_dir(row["run_id"]) / f"{stamp()}.parquet")


def start_run(path: str | Path, run: dict) -> None:
    """Record a run as running (a rerun of the same run id starts a new state).

    run: a rows.RUN row; `params` may be a dict (stored as JSON); status, reason and finished are set here.
    """
    params = run.get("params", {})
    layout = ensure(path)
    _write_state(layout, {**run, "params": params if isinstance(params, str) else json.dumps(params),
                          "finished": None, "status": "running", "reason": None})


def finish_run(path: str | Path, run_id: str, status: str, *, finished=None, reason: str | None = None) -> None:
    """Record how a run ended: completed, failed (with the error's one-line reason) or cancelled."""
    if status not in RUN_STATUSES or status == "running":
        raise RowError(f"run rows: status {status!r} does not end a run")
    layout = ensure(path)
    row = _latest_state(layout, run_id) or {"run_id": run_id, "model": ""}
    _write_state(layout, {**row, "status": status, "finished": finished, "reason": reason})


def _staged_effects(source: Path):
    """A staged effect file's rows in the EFFECT shape, BATCH_ROWS at a time, their closed columns checked."""
    staged = pq.ParquetFile(source)
    missing = [c for c in EFFECT.columns if c not in staged.schema_arrow.names]
    if missing:
        raise RowError(f"effect file {source}: no column {missing[0]!r}")
    for batch in staged.iter_batches(batch_size=BATCH_ROWS, columns=EFFECT.columns):
        table = pa.Table.from_batches([batch]).select(EFFECT.columns).cast(EFFECT.schema)
        EFFECT.check(table)
        yield table


def load_run(path: str | Path, run_id: str, pairs, baselines, effect_files, *, finished=None,
             status: str = "completed", sweep_kinds: dict[str, str] | None = None, progress=None) -> dict:
    """Publish a run's pairs table, baselines and effect Parquet files as its new load, replacing
    its earlier one, and record the run as `status`.

    pairs: a pyarrow table in the rows.PAIR shape; baselines: rows.BASELINE rows (a list of dicts or
    a table); effect_files: Parquet files in the rows.EFFECT shape; sweep_kinds: {sweep: row shape}
    (SweepKind.row_shape: patchgrid.sweeps.registry.row_shapes()) of the kinds the rows may come
    from: each row is filed under its sweep's shape (kinds.py; a sweep it does not name has exact
    rows), and a row setting a column its shape does not have is refused. `progress`: told (files
    done, files), the effect files one by one and then the pairs and baselines. Returns counts of
    rows loaded.
    """
    shapes_of = shapes_by_sweep(sweep_kinds)
    PAIR.check(pairs)
    base_table = BASELINE.table(baselines) if isinstance(baselines, list) else baselines.select(BASELINE.columns)
    BASELINE.check(base_table)
    layout = ensure(path)
    counts = {"pairs": pairs.num_rows, "baselines": base_table.num_rows, "effects": 0}

    files = len(effect_files) + 1  # the effect files, then the rest at once
    progress = progress or (lambda done, total: None)

    def fill(folder: Path) -> None:
        effects = ShapedEffects(folder / "effects")
        progress(0, files)
        for k, f in enumerate(effect_files):
            counts["effects"] += effects.write(k, _staged_effects(Path(f)), shapes_of)
            progress(k + 1, files)
        pq.write_table(base_table.cast(BASELINE.schema), folder / "baselines.parquet")
        pq.write_table(effects.record(), folder / "sweep_kinds.parquet")
        pq.write_table(pairs.select(PAIR_IN_WAREHOUSE.columns).cast(PAIR_IN_WAREHOUSE.schema),
                       folder / "pairs.parquet")
        progress(files, files)

    publish_dir(fill, layout.run_dir(run_id), f"load={stamp()}")
    row = _latest_state(layout, run_id) or {"run_id": run_id, "model": ""}
    _write_state(layout, {**row, "status": status, "finished": finished, "reason": None})
    remove_superseded(layout, run_id)
    return counts


def connect(path: str | Path, query: str | None = None):
    """A read-only connection to the warehouse (a snapshot of its published loads; see catalog.py);
    made for `query` (its SQL): of the summary views, only those it reads (catalog.open_snapshot)."""
    import duckdb

    layout = Layout.of(path)
    if not layout.catalog.exists() and not layout.exists():
        raise WarehouseError(f"warehouse {path} does not exist (run a study first)")
    # the data folder is all a reader needs; the DuckDB file is asked only when there is none
    kind = "catalog" if layout.exists() else _identify(layout.catalog)[0]
    if kind == "v1":  # not migrated yet (that takes a writer): read its tables as they are
        con = duckdb.connect(str(layout.catalog), read_only=True, config=BASE_CONFIG)
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        return con
    if not layout.exists():
        raise WarehouseError(f"warehouse {path}: its data folder {layout.data} is missing")
    if _check_version(layout):  # migrated from an older schema: its dashboard file is rewritten too
        ensure(path)
    try:
        return open_snapshot(layout, query)
    except duckdb.Error as exc:
        raise WarehouseError(f"warehouse {path} cannot be read: {str(exc).strip().splitlines()[0]}") from None


def _refusal(sql: str) -> str | None:
    import duckdb

    try:
        kinds = [str(s.type).rsplit(".", 1)[-1] for s in duckdb.extract_statements(sql)]
    except duckdb.Error:
        return None  # let the query itself report the syntax error
    for kind in kinds:
        if kind not in QUERY_STATEMENTS:
            return (f"query refused: a {kind} statement; the warehouse is read-only to queries "
                    f"(SELECT, WITH, SHOW, DESCRIBE, SUMMARIZE)")
    return None


def query(path: str | Path, sql: str, params=None, *, arrow: bool = False):
    """Run SQL that reads the warehouse: nothing a query says can change it or touch another file.
    Returns (columns, rows); with `arrow`, a pyarrow table in DuckDB's own column types."""
    import duckdb

    refusal = _refusal(sql)
    if refusal:
        raise WarehouseError(refusal)
    con = connect(path, sql)
    try:
        try:
            return _run(con, sql, params, arrow)
        except duckdb.CatalogException:
            # a view its text does not name, or no such name: asked again with every view, so that it runs,
            # or fails as it would with them all (DuckDB's suggestions are drawn from the whole catalog)
            con.close()
            con = connect(path)
            return _run(con, sql, params, arrow)
    except duckdb.PermissionException as exc:
        first = str(exc).strip().splitlines()[0]
        raise WarehouseError(f"query refused: {first} (a query reads the warehouse only: no files, no extensions)") \
            from None
    except duckdb.Error as exc:
        raise WarehouseError(f"query failed: {_with_hints(exc)}") from exc
    finally:
        con.close()


def _run(con, sql: str, params, arrow: bool):
    if arrow:
        return con.sql(sql, params=params or None).to_arrow_table()
    cur = con.execute(sql, params or [])
    cols = [d[0] for d in cur.description] if cur.description else []
    return cols, cur.fetchall()


# DuckDB's lines that say what was meant, kept beside the first line of its message
_HINTS = ("did you mean", "candidate bindings", "hint")


def _with_hints(exc: Exception) -> str:
    """DuckDB's error on one line: its first line and its hints ("Did you mean ...?", the candidate
    bindings), without the query echo and caret lines."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    hints = [line for line in lines[1:] if line.lower().startswith(_HINTS)]
    return "; ".join(lines[:1] + hints)
