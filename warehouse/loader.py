"""Open, version and load the DuckDB warehouse.

Loads are idempotent (a run's rows for the loaded pairs are replaced, never duplicated), one
writer at a time (an exclusive lock file queues concurrent writers, so nobody sees DuckDB's lock
error), and atomic (one transaction: a failed load leaves the warehouse as it was).
"""
from __future__ import annotations

import fcntl
import json
import time
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from patchgrid.rows import BASELINE, EFFECT, PAIR, RUN, WAREHOUSE_TABLES

SCHEMA_VERSION = 1

# A read-only connection (queries, the report) reads the warehouse and nothing else: no file is read
# or written through SQL (COPY, read_csv, ATTACH, EXPORT), no extension is installed or loaded, and
# these settings cannot be changed back from SQL.
READ_ONLY_CONFIG = {"enable_external_access": False, "lock_configuration": True,
                    "autoload_known_extensions": False, "autoinstall_known_extensions": False}


class WarehouseError(ValueError):
    """A warehouse file that cannot be used; the message names the file and the problem."""


def _sql(name: str) -> str:
    return resources.files("patchgrid.warehouse").joinpath(name).read_text()


@contextmanager
def writer_lock(path: Path):
    """Exclusive across processes: DuckDB allows one writing process per file."""
    lock = Path(str(path) + ".lock")
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def connect(path: str | Path, *, read_only: bool = False, wait_s: float = 60.0):
    """A connection to a warehouse whose schema this code knows; creates it when writing."""
    import duckdb

    path = Path(path)
    if read_only and not path.exists():
        raise WarehouseError(f"warehouse {path} does not exist (run a study first)")
    if path.exists() and path.is_dir():
        raise WarehouseError(f"warehouse {path} is a folder, not a DuckDB file")
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            head = f.read(16)
        if head[8:12] != b"DUCK":
            raise WarehouseError(f"warehouse {path} is not a DuckDB file")
    if not read_only and path.exists() and not path.stat().st_mode & 0o222:
        # honoured even for root, who could write anyway: the user marked it read-only
        raise WarehouseError(f"warehouse {path} is read-only (its file mode allows no writing)")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            con = duckdb.connect(str(path), read_only=read_only, config=READ_ONLY_CONFIG if read_only else {})
            break
        except duckdb.IOException as exc:
            msg = str(exc)
            if "lock" in msg.lower() and time.monotonic() < deadline:
                time.sleep(0.2)  # another process is writing: wait our turn
                continue
            if "Permission denied" in msg or "Read-only file system" in msg:
                raise WarehouseError(f"warehouse {path} cannot be opened for writing: permission denied") from None
            raise WarehouseError(f"warehouse {path} cannot be opened: {msg.splitlines()[0]}") from None
        except duckdb.Error as exc:
            raise WarehouseError(f"warehouse {path} cannot be opened: {str(exc).splitlines()[0]}") from None
    try:
        _check_schema(con, path, read_only)
    except Exception:
        con.close()
        raise
    return con


def _check_schema(con, path: Path, read_only: bool) -> None:
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if "patchgrid_schema" not in tables:
        if tables:
            raise WarehouseError(f"warehouse {path} is a DuckDB file but not a patchgrid warehouse")
        if read_only:
            raise WarehouseError(f"warehouse {path} is empty (run a study first)")
        con.execute("BEGIN")
        con.execute(_sql("schema.sql"))
        con.execute("INSERT INTO patchgrid_schema VALUES (?)", [SCHEMA_VERSION])
        con.execute(_sql("views.sql"))
        con.execute("COMMIT")
        return
    row = con.execute("SELECT max(version) FROM patchgrid_schema").fetchone()
    version = row[0] if row else None
    if version is None:
        raise WarehouseError(f"warehouse {path} has no schema version")
    if version > SCHEMA_VERSION:
        raise WarehouseError(f"warehouse {path} is from a newer patchgrid (schema v{version}; this one knows "
                             f"v{SCHEMA_VERSION}): upgrade patchgrid")
    if not read_only:
        con.execute(_sql("views.sql"))  # views are code: refresh them on every write


def check_writable(path: str | Path) -> None:
    """Fail early, before a study runs, on a warehouse it could not load into."""
    path = Path(path)
    if path.exists():
        with writer_lock(path):
            connect(path).close()
    elif not path.parent.is_dir():
        raise WarehouseError(f"warehouse {path}: folder {path.parent} does not exist")


def start_run(path: str | Path, run: dict) -> None:
    """Record a run as running (replacing an earlier attempt of the same run id).

    run: a rows.RUN row; `params` may be a dict (stored as JSON); status and finished are set here.
    """
    params = run.get("params", {})
    row = {**run, "params": params if isinstance(params, str) else json.dumps(params), "finished": None,
           "status": "running"}
    new_run = RUN.table([row])
    with writer_lock(Path(path)):
        con = connect(path)
        try:
            con.execute("BEGIN")
            con.execute("DELETE FROM runs WHERE run_id = ?", [run["run_id"]])
            con.register("new_run", new_run)
            con.execute("INSERT INTO runs BY NAME SELECT * FROM new_run")
            con.execute("COMMIT")
        finally:
            con.close()


def _insert_for_run(con, table: str, source: str, run_id: str) -> int:
    """Insert `source`'s rows (a registered table or a read_parquet call) into `table` by column name,
    taking exactly the columns of the table's row shape."""
    cols = ", ".join(f'"{c}"' for c in WAREHOUSE_TABLES[table].columns)
    return con.execute(f"INSERT INTO {table} BY NAME SELECT ?::VARCHAR AS run_id, {cols} FROM {source}",
                       [run_id]).fetchone()[0]


def load_run(path: str | Path, run_id: str, pairs, baselines, effect_files, *, finished=None,
             status: str = "completed") -> dict:
    """Load a run's pairs table, baselines and effect Parquet files in one transaction.

    pairs: a pyarrow table in the rows.PAIR shape; baselines: rows.BASELINE rows (a list of dicts or
    a table); effect_files: Parquet files in the rows.EFFECT shape. Rows of this run for the loaded
    pairs are replaced. Returns counts of rows loaded.
    """
    path = Path(path)
    PAIR.check(pairs)
    base_table = BASELINE.table(baselines) if isinstance(baselines, list) else baselines
    with writer_lock(path):
        con = connect(path)
        try:
            con.execute("BEGIN")
            con.register("new_pairs", pairs)
            con.execute("CREATE TEMP TABLE loaded_ids AS SELECT DISTINCT pair_id FROM new_pairs")
            for table in ("pairs", "baselines", "effects"):
                con.execute(f"DELETE FROM {table} WHERE run_id = ? AND pair_id IN (SELECT pair_id FROM loaded_ids)",
                            [run_id])
            _insert_for_run(con, "pairs", "new_pairs", run_id)
            con.register("new_baselines", base_table)
            _insert_for_run(con, "baselines", "new_baselines", run_id)
            n_effects = 0
            for f in effect_files:
                source = f"read_parquet('{_sql_path(f)}')"
                _check_closed(con, source, EFFECT)
                n_effects += _insert_for_run(con, "effects", source, run_id)
            con.execute("UPDATE runs SET status = ?, finished = ? WHERE run_id = ?", [status, finished, run_id])
            con.execute("DROP TABLE loaded_ids")
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
        finally:
            con.close()
    return {"pairs": pairs.num_rows, "baselines": base_table.num_rows, "effects": n_effects}


def _check_closed(con, source: str, shape) -> None:
    """The closed columns' values in a file, checked against the shape before anything is inserted."""
    import pyarrow as pa

    for column in shape.closed:
        values = con.execute(f'SELECT DISTINCT "{column}" FROM {source}').fetchall()
        shape.check(pa.table({column: pa.array([v for (v,) in values], pa.string())}), columns=[column])


def _sql_path(path) -> str:
    return str(path).replace("'", "''")


def query(path: str | Path, sql: str, params=None):
    """Run SQL on a read-only connection: nothing a query says can change the warehouse."""
    import duckdb

    con = connect(path, read_only=True)
    try:
        cur = con.execute(sql, params or [])
        cols = [d[0] for d in cur.description] if cur.description else []
        return cols, cur.fetchall()
    except duckdb.PermissionException as exc:
        first = str(exc).strip().splitlines()[0]
        raise WarehouseError(f"query refused: {first} (a query reads the warehouse only: no files, no extensions)") \
            from None
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0]
        raise WarehouseError(f"query failed: {first}") from None
    finally:
        con.close()
