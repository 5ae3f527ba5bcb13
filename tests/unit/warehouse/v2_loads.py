"""Warehouses of schema v2 as patchgrid wrote them before loads filed effect rows by shape: a run's
effect rows in one file of the one wide shape (effects/part-00000.parquet), knockout rows as
direction `noise`, site `pattern`, and each load's record of its kinds (sweep, drawing, row_shape:
every registered kind, or none). Written here from rows made today, so that migration tests need no
checked-in warehouse."""
from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from patchgrid.rows.shapes import BASELINE, EFFECT, PAIR_IN_WAREHOUSE, RUN
from patchgrid.sweeps import SWEEP_KINDS
from patchgrid.warehouse.layout import Layout, publish_dir, publish_file, stamp

# How schema v2 recorded a kind: by how the report draws it, and the row shape it took from that
V2_DRAWING_SHAPES = {"atp": "estimate", "paths": "path", "trace_buckets": "noised", "edges": "edge",
                     "circuit": "circuit", "knockout": "knockout"}
V2_RECORD = pa.schema([("sweep", pa.string()), ("drawing", pa.string()), ("row_shape", pa.string())])


def v2_effects(rows: list[dict], columns: list[str] | None = None) -> pa.Table:
    """Today's effect rows as v2 wrote them: every column of the wide shape (or `columns` only),
    knockout rows as a noising patch of the attention pattern."""
    table = EFFECT.table(rows)
    knockout = pc.equal(table.column("sweep"), "knockout")
    for column, value in (("direction", "noise"), ("site", "pattern")):
        k = table.schema.get_field_index(column)
        table = table.set_column(k, column, pc.if_else(knockout, value, table.column(column)))
    return table if columns is None else table.select(columns)


def v2_record(recorded: bool) -> pa.Table:
    """A v2 load's record of its kinds: every registered kind (as a study recorded them), or none."""
    kinds = [{"sweep": name, "drawing": kind.drawing, "row_shape": V2_DRAWING_SHAPES.get(kind.drawing, "exact")}
             for name, kind in SWEEP_KINDS.items()] if recorded else []
    return pa.Table.from_pylist(kinds, schema=V2_RECORD)


def v2_warehouse(wh: Path) -> Layout:
    """An empty v2 warehouse: its version, its empty load of the wide shape, and its view file."""
    layout = Layout.of(wh)
    layout.data.mkdir(parents=True)
    publish_file(lambda tmp: tmp.write_text(json.dumps({"schema": 2}) + "\n"), layout.version_file)
    _publish(layout, "_", PAIR_IN_WAREHOUSE.table([]), BASELINE.table([]), EFFECT.table([]), v2_record(False),
             "0-v2empty")
    con = duckdb.connect(str(wh))
    con.execute("CREATE TABLE patchgrid_catalog (schema INTEGER, data VARCHAR, views VARCHAR)")
    con.execute("INSERT INTO patchgrid_catalog VALUES (2, ?, 'v2-views')", [str(layout.data.resolve())])
    con.close()
    return layout


def v2_load(layout: Layout, run_id: str, pairs: pa.Table, baselines: list[dict] | pa.Table, effects: pa.Table,
            recorded: bool | None = True) -> None:
    """A completed run's load as v2 published it (the pairs' columns the warehouse keeps, of those
    `pairs` has); `recorded` None: a load from before loads recorded their kinds (no record file)."""
    record = None if recorded is None else v2_record(recorded)
    pairs = pairs.select([c for c in PAIR_IN_WAREHOUSE.columns if c in pairs.column_names])
    baselines = baselines if isinstance(baselines, pa.Table) else BASELINE.table(baselines)
    _publish(layout, run_id, pairs, baselines, effects, record, stamp())
    state = RUN.table([{"run_id": run_id, "model": "m", "params": "{}", "status": "completed"}])
    publish_file(lambda tmp: pq.write_table(state, tmp), layout.status_dir(run_id) / f"{stamp()}.parquet")


def _publish(layout, run_id, pairs, baselines, effects, record, load) -> None:
    def fill(folder: Path) -> None:
        (folder / "effects").mkdir()
        pq.write_table(effects, folder / "effects" / "part-00000.parquet")
        pq.write_table(baselines, folder / "baselines.parquet")
        if record is not None:
            pq.write_table(record, folder / "sweep_kinds.parquet")
        pq.write_table(pairs, folder / "pairs.parquet")

    publish_dir(fill, layout.run_dir(run_id), f"load={load}")
