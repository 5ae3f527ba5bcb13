"""How the warehouse files a load's effect rows: by their row shape, each shape in a folder of its own
holding its columns only, and the load's record of the shape of each sweep's rows.

The warehouse knows no sweep kind by name (it imports nothing of patchgrid.sweeps): a study's
loader is handed {sweep: row shape} by its caller (`SweepKind.row_shape`, registry.row_shapes), and
files each row under its sweep's shape (patchgrid/rows/shapes.py, `EFFECT_SHAPES`):

    effects/row_shape=<shape>/part-<k>.parquet    the shape's rows of staged file k, its columns only

A row that sets a column its shape does not have is refused (so an attribution-patching row filed as
exact cannot reach the effect views). The `effects` view reads every shape's files at once, each row
with its `row_shape` (a column another shape has is NULL there), and the views select rows by it:

    exact     one patched run per row, its effect its own (the effect views)
    estimate  an attribution-patching estimate per row, only a selected subset also patched
              exactly: in no effect view, read by atp_summary and atp_agreement
    path      one path from a sender to a receiver per row: in the effect views, and path_summary
    noised    causal tracing: the clean prompt with noise on the subject, `corrupt_*` the noised
              run's readings, so a row stands on one fact: in the effect views, and trace_buckets
    edge      one edge's attribution score per row: edge_summary
    circuit   one circuit run of a pair per row: circuit_curve, circuit_score
    knockout  one attention knockout of a fact per row: knockout_curve

Each load records the shape of each sweep it holds rows of in `sweep_kinds.parquet` (the
`sweep_kinds` view), which views that work per sweep read (noised_sweeps).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from patchgrid.rows.shapes import EFFECT, EFFECT_SHAPES, ROW_SHAPES, RowError, RowShape

# A sweep its load is not told the shape of has the rows every kind has unless it declares others.
UNDECLARED_SHAPE = "exact"
# Effect rows held at once while a load files them by shape
BATCH_ROWS = 1 << 18

SWEEP_KIND = RowShape("sweep_kind", pa.schema([
    ("sweep", pa.string()),
    ("row_shape", pa.string()),  # one of ROW_SHAPES
]), {"row_shape": ROW_SHAPES})


def shape_folder(effects: Path, shape: str) -> Path:
    """Where a load's rows of `shape` are (a hive partition: the views read `row_shape` from it)."""
    return effects / f"row_shape={shape}"


def shapes_by_sweep(sweep_kinds: dict[str, str] | None) -> Callable[[pa.Table], pa.Array]:
    """Each row's shape by its sweep's in `sweep_kinds` ({sweep: row shape}; a sweep not in it:
    UNDECLARED_SHAPE); a shape that is none of ROW_SHAPES is refused."""
    kinds = dict(sweep_kinds or {})
    SWEEP_KIND.table([{"sweep": sweep, "row_shape": shape} for sweep, shape in kinds.items()])  # refuses a non-shape
    sweeps, shapes = pa.array(list(kinds), pa.string()), pa.array(list(kinds.values()), pa.string())

    def of(table: pa.Table) -> pa.Array:
        return pc.fill_null(pc.take(shapes, pc.index_in(table.column("sweep"), value_set=sweeps)), UNDECLARED_SHAPE)

    return of


def _words(shape: RowShape) -> list[str]:
    """The shape's text columns: those Parquet dictionary-encodes (a reading's floats rarely repeat,
    and encoding them so makes the files larger and their writing twice as slow)."""
    return [f.name for f in shape.schema if f.type == pa.string()]


def _check_fits(rows: pa.Table, shape: RowShape) -> None:
    """Refuse rows that set a column their shape does not have."""
    for column in EFFECT.columns:
        if column not in shape.schema.names and rows.column(column).null_count < rows.num_rows:
            values = rows.column(column)
            sweep = pc.filter(rows.column("sweep"), pc.is_valid(values))[0].as_py()
            raise RowError(f"effect rows of sweep {sweep!r}: {column} is set, and their shape, {shape.name}, has no "
                           f"such column (a kind's rows are filed by its row_shape)")


class ShapedEffects:
    """A load's effect files, written by shape into `effects` (a folder of the load being built), and
    the shape each sweep's rows were filed under (`sweeps`, the load's record)."""

    def __init__(self, effects: Path):
        self.effects, self.sweeps = effects, {}
        effects.mkdir(exist_ok=True)

    def write(self, part: int, tables: Iterable[pa.Table], shapes_of: Callable[[pa.Table], pa.Array]) -> int:
        """Rows in the EFFECT shape (table by table: one is held at a time), each filed under its shape
        (`shapes_of`: the shape of each row of a table) as part `part`. Returns the number of rows."""
        writers: dict[str, pq.ParquetWriter] = {}
        n = 0
        try:
            for table in tables:
                shapes = shapes_of(table)
                names = pc.unique(shapes).to_pylist()
                for name in names:
                    shape = EFFECT_SHAPES[name]
                    rows = table if len(names) == 1 else table.filter(pc.equal(shapes, name))
                    _check_fits(rows, shape)
                    for sweep in pc.drop_null(pc.unique(rows.column("sweep"))).to_pylist():
                        if self.sweeps.setdefault(sweep, name) != name:
                            raise RowError(f"effect rows of sweep {sweep!r}: filed as {self.sweeps[sweep]} and as "
                                           f"{name}; a sweep's rows have one shape")
                    if name not in writers:
                        folder = shape_folder(self.effects, name)
                        folder.mkdir(exist_ok=True)
                        writers[name] = pq.ParquetWriter(folder / f"part-{part:05d}.parquet", shape.schema,
                                                         use_dictionary=_words(shape))
                    writers[name].write_table(rows.select(shape.columns))
                n += table.num_rows
        finally:
            for writer in writers.values():
                writer.close()
        return n

    def record(self) -> pa.Table:
        """The load's record: each sweep it holds rows of, and their shape."""
        return SWEEP_KIND.table([{"sweep": sweep, "row_shape": shape} for sweep, shape in sorted(self.sweeps.items())])


def empty_effects(effects: Path) -> None:
    """An empty file of every shape (the warehouse's empty load: every column of every shape is in one)."""
    effects.mkdir(exist_ok=True)
    for name, shape in EFFECT_SHAPES.items():
        shape_folder(effects, name).mkdir()
        pq.write_table(shape.table([]), shape_folder(effects, name) / "part-00000.parquet")
