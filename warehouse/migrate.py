"""Older schemas to today's, one step at a time.

v1 (every table inside one DuckDB file) to v2 (Parquet per run, views in the DuckDB file): each v1
run becomes one status file and, when it has rows, one load; the v1 file is kept beside the
warehouse as `<name>.v1.duckdb` and the dashboard file is written in its place.

v2 (a load's effect rows in one shape, effects/part-<k>.parquet, told apart by which of their
columns are set) to v3 (filed by row shape, kinds.py): each run's published load is written again as
a new load, its rows filed under the shape the v2 views took them for, its knockout rows saying so
(direction `knockout`, site `attention_edges`, where v2 wrote `noise` and `pattern`). The load it
replaces is removed as any superseded load is (layout.remove_superseded, at the run's next load).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from patchgrid.rows.shapes import BASELINE, EFFECT, KNOCKOUT_DIRECTION, KNOCKOUT_SITE, PAIR_IN_WAREHOUSE, RUN, RowError

from .catalog import BASE_CONFIG
from .kinds import BATCH_ROWS, ShapedEffects, shape_folder
from .layout import EMPTY_RUN, Layout, publish_dir, publish_file, remove_superseded, stamp


def _select(con, table: str, shape, run_id: str) -> pa.Table:
    """The v1 table's rows of the run, in the shape's columns that v1 had (the views read the
    others, added since, as NULL)."""
    had = {r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = ?",
                                     [table]).fetchall()}
    cols = ", ".join(f'"{c}"' for c in shape.columns if c != "run_id" and c in had)
    got = con.sql(f"SELECT {cols} FROM {table} WHERE run_id = ?", params=[run_id]).to_arrow_table()
    return got.cast(pa.schema([shape.schema.field(c) for c in got.column_names]))


@contextmanager
def _migrating(layout: Layout):
    """Held while the warehouse is migrated: two studies starting at once, one migrates."""
    with open(str(layout.catalog) + ".migrating", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write_version(layout: Layout, version: int) -> None:
    publish_file(lambda tmp: tmp.write_text(json.dumps({"schema": version}) + "\n"), layout.version_file)


def migrate_v1(layout: Layout) -> str:
    """Migrate the v1 file at layout.catalog to v2; returns the message to show."""
    import duckdb

    backup = layout.catalog.with_name(layout.catalog.stem + ".v1.duckdb")
    with _migrating(layout):
        try:
            con = duckdb.connect(str(layout.catalog), read_only=True, config=BASE_CONFIG)
        except duckdb.Error:
            if backup.exists():  # the other one did
                return f"warehouse {layout.catalog}: migrated from schema v1 by another process"
            raise
        try:
            tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
            if "patchgrid_catalog" in tables:
                return f"warehouse {layout.catalog}: migrated from schema v1 by another process"
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
        _write_version(layout, 2)  # and on to v3 (migrate_v2), as any v2 warehouse
        os.replace(layout.catalog, backup)  # ensure() writes the view file next
    return (f"warehouse {layout.catalog}: migrated from schema v1 to v2 ({len(runs)} runs, "
            f"{n_effects:,} effect rows, now Parquet files under {layout.data}); the v1 file is kept as {backup}")


# The columns a v2 view told an effect row's shape by, in the order it asked: a row with `blocked` set
# was a knockout's, with `circuit_size` a circuit's, with `estimate` and `receiver` an edge's, with
# `estimate` alone an estimate, with `receiver` alone a path; the rest were exact, or noised where
# their sweep was (_noised_sweeps).
_V2_SHAPES = (("knockout", ("blocked",)), ("circuit", ("circuit_size",)), ("edge", ("estimate", "receiver")),
              ("estimate", ("estimate",)), ("path", ("receiver",)))


def _v2_effects(load: Path):
    """A v2 load's effect rows in today's EFFECT shape, file by file and BATCH_ROWS at a time (a
    column a file lacks, written before it existed, is NULL)."""
    for f in sorted((load / "effects").glob("*.parquet")):
        written = pq.ParquetFile(f)
        have = [c for c in EFFECT.columns if c in written.schema_arrow.names]
        for batch in written.iter_batches(batch_size=BATCH_ROWS, columns=have):
            n = batch.num_rows
            yield pa.table({c: batch.column(c).cast(EFFECT.schema.field(c).type) if c in have
                            else pa.nulls(n, EFFECT.schema.field(c).type) for c in EFFECT.columns})


def _noised_sweeps(load: Path) -> pa.Array:
    """The load's sweeps whose rows v2 took as noised (causal tracing's): those its record says are,
    or for a load with no record, those with rows on p(answer) as their headline metric (v2's rule:
    only tracing's were)."""
    record = load / "sweep_kinds.parquet"
    kinds = pq.read_table(record) if record.is_file() else None
    if kinds is not None and kinds.num_rows and "row_shape" in kinds.column_names:
        return pc.filter(kinds.column("sweep"), pc.equal(kinds.column("row_shape"), "noised")).combine_chunks()
    sweeps = set()
    for f in sorted((load / "effects").glob("*.parquet")):
        for batch in pq.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS, columns=["sweep", "metric"]):
            sweeps.update(pc.filter(batch.column("sweep"), pc.equal(batch.column("metric"), "p")).to_pylist())
    return pa.array(sorted(s for s in sweeps if s is not None), pa.string())


def _v2_shapes(noised: pa.Array):
    """Each row's shape as the v2 views took it (_V2_SHAPES, then its sweep's)."""

    def of(table: pa.Table) -> pa.Array:
        shapes = pc.if_else(pc.is_in(table.column("sweep"), value_set=noised), "noised", "exact")
        for name, columns in reversed(_V2_SHAPES):  # the first that applies decides
            is_set = [pc.is_valid(table.column(c)) for c in columns]
            shapes = pc.if_else(is_set[0] if len(is_set) == 1 else pc.and_(*is_set), name, shapes)
        return shapes

    return of


def _as_today(tables, shapes_of):
    """v2 rows with a knockout's direction and site saying it is one."""
    for table in tables:
        knockout = pc.equal(shapes_of(table), "knockout")
        for column, value in (("direction", KNOCKOUT_DIRECTION), ("site", KNOCKOUT_SITE)):
            k = table.schema.get_field_index(column)
            table = table.set_column(k, column, pc.if_else(knockout, value, table.column(column)))
        EFFECT.check(table)
        yield table


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(source, target)


def _migrate_load(layout: Layout, run_id: str, load: Path) -> int:
    """The v2 load written again as the run's new load; returns its effect rows."""
    shapes_of = _v2_shapes(_noised_sweeps(load))
    rows = 0

    def fill(folder: Path) -> None:
        nonlocal rows
        effects = ShapedEffects(folder / "effects")
        rows = effects.write(0, _as_today(_v2_effects(load), shapes_of), shapes_of)
        for name in ("baselines.parquet", "pairs.parquet"):  # pairs last: a load is published by it
            _link(load / name, folder / name)
        pq.write_table(effects.record(), folder / "sweep_kinds.parquet")

    try:
        publish_dir(fill, layout.run_dir(run_id), f"load={stamp()}")
    except RowError as exc:
        raise RowError(f"warehouse {layout.catalog}: run {run_id!r} ({load.name}) cannot be migrated: {exc}") from None
    remove_superseded(layout, run_id)
    return rows


def migrate_v2(layout: Layout) -> str:
    """Migrate the v2 data folder of layout to v3; returns the message to show."""
    with _migrating(layout):
        if layout.version() >= 3:
            return f"warehouse {layout.catalog}: migrated from schema v2 by another process"
        n_runs = n_effects = 0
        for run_dir in sorted(layout.runs.glob("run_id=*")) if layout.runs.is_dir() else []:
            run_id = run_dir.name.removeprefix("run_id=")
            loads = [p for p in layout.loads(run_id) if (p / "pairs.parquet").is_file()]
            if run_id == EMPTY_RUN or not loads:
                continue  # the empty load is made afresh (loader.ensure)
            latest = loads[-1]
            if next((latest / "effects").glob(shape_folder(Path(), "*").name), None) is not None:
                continue  # migrated already, by a migration that stopped before it was done
            n_effects += _migrate_load(layout, run_id, latest)
            n_runs += 1
        _write_version(layout, 3)
    return (f"warehouse {layout.catalog}: migrated from schema v2 to v3 ({n_runs} runs, "
            f"{n_effects:,} effect rows filed by row shape)")
