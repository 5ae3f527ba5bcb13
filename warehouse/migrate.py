"""Schema v1 (every table inside one DuckDB file) to v2 (Parquet per run, views in the DuckDB file).

Each v1 run becomes one status file and, when it has rows, one load; the v1 file is kept beside
the warehouse as `<name>.v1.duckdb` and the dashboard file is written in its place.
"""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from patchgrid.rows.shapes import BASELINE, EFFECT, PAIR_IN_WAREHOUSE, RUN

from .catalog import BASE_CONFIG
from .layout import SCHEMA_VERSION, Layout, publish_dir, publish_file, stamp


def _select(con, table: str, shape, run_id: str) -> pa.Table:
    """The v1 table's rows of the run, in the shape's columns that v1 had (the views read the
    others, added since, as NULL)."""
    had = {r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = ?",
                                     [table]).fetchall()}
    cols = ", ".join(f'"{c}"' for c in shape.columns if c != "run_id" and c in had)
    got = con.sql(f"SELECT {cols} FROM {table} WHERE run_id = ?", params=[run_id]).to_arrow_table()
    return got.cast(pa.schema([shape.schema.field(c) for c in got.column_names]))


def migrate_v1(layout: Layout) -> str:
    """Migrate the v1 file at layout.catalog; returns the message to show."""
    import duckdb

    backup = layout.catalog.with_name(layout.catalog.stem + ".v1.duckdb")
    with open(str(layout.catalog) + ".migrating", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two studies starting at once: one migrates
        try:
            con = duckdb.connect(str(layout.catalog), read_only=True, config=BASE_CONFIG)
        except duckdb.Error:
            if backup.exists():  # the other one did
                return f"warehouse {layout.catalog}: migrated to schema v{SCHEMA_VERSION} by another process"
            raise
        try:
            tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
            if "patchgrid_catalog" in tables:
                return f"warehouse {layout.catalog}: migrated to schema v{SCHEMA_VERSION} by another process"
            layout.data.mkdir(exist_ok=True)
            run_cols = [c for c in RUN.columns if c != "reason"]
            runs = con.sql(f"SELECT {', '.join(run_cols)} FROM runs").to_arrow_table().to_pylist()
            n_effects = 0
            for run in runs:
                run_id = run["run_id"]
                run["params"] = run["params"] if isinstance(run["params"], str) or run["params"] is None \
                    else json.dumps(run["params"])
                pairs = _select(con, "pairs", PAIR_IN_WAREHOUSE, run_id)
                if pairs.num_rows:
                    baselines = _select(con, "baselines", BASELINE, run_id)
                    effects = _select(con, "effects", EFFECT, run_id)
                    n_effects += effects.num_rows

                    def fill(folder: Path, pairs=pairs, baselines=baselines, effects=effects) -> None:
                        (folder / "effects").mkdir()
                        pq.write_table(effects, folder / "effects" / "part-00000.parquet")
                        pq.write_table(baselines, folder / "baselines.parquet")
                        pq.write_table(pairs, folder / "pairs.parquet")

                    publish_dir(fill, layout.run_dir(run_id), f"load={stamp()}")
                table = RUN.table([{**run, "reason": None}])
                publish_file(lambda tmp, t=table: pq.write_table(t, tmp),
                             layout.status_dir(run_id) / f"{stamp()}.parquet")
        finally:
            con.close()
        publish_file(lambda tmp: tmp.write_text(json.dumps({"schema": SCHEMA_VERSION}) + "\n"), layout.version_file)
        os.replace(layout.catalog, backup)  # ensure() writes the view file next
    return (f"warehouse {layout.catalog}: migrated from schema v1 to v{SCHEMA_VERSION} ({len(runs)} runs, "
            f"{n_effects:,} effect rows, now Parquet files under {layout.data}); the v1 file is kept as {backup}")
