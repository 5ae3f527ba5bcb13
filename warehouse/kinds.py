"""What the warehouse records of a run's sweep kinds: how each is drawn and the shape of its rows.

The warehouse knows no sweep kind by name (it imports nothing of patchgrid.sweeps): a study's
loader is handed its kinds by its caller, as {sweep: drawing} (`SweepKind.drawing`, how the report
draws the kind), and each load records them in `sweep_kinds.parquet` (the `sweep_kinds` view). The
views select rows by what they are:

    exact     one patched run per row, its effect its own (the effect views)
    estimate  an attribution-patching estimate per row (`estimate` set), only a selected subset
              also patched exactly: in no effect view, read by atp_summary and atp_agreement
    path      one path from a sender to a receiver per row (`receiver` set): path_summary
    edge      one edge's attribution score per row (`estimate` and `receiver` set): edge_summary
    circuit   one circuit run of a pair per row (`circuit_size` set): circuit_curve, circuit_score
    knockout  one attention knockout of a fact per row (`blocked` set): knockout_curve
    noised    causal tracing: the clean prompt with noise on the subject, `corrupt_*` the noised
              run's readings, so a row stands on one fact (the clean prompt): trace_buckets

Estimates, paths, edges, circuits and knockouts say so in their own columns; a noised row does
not, so the views take it from the record (`noised_sweeps`). A load written before runs recorded
their kinds has none: its sweeps on p(answer) as their headline metric are taken as noised, which
only causal tracing was.
"""
from __future__ import annotations

import pyarrow as pa

from patchgrid.rows.shapes import RowShape

ROW_SHAPES = ("exact", "estimate", "path", "noised", "edge", "circuit", "knockout")
# A kind's row shape by how the report draws it; every other drawing's rows are exact.
DRAWING_SHAPES = {"atp": "estimate", "paths": "path", "trace_buckets": "noised", "edges": "edge",
                  "circuit": "circuit", "knockout": "knockout"}

SWEEP_KIND = RowShape("sweep_kind", pa.schema([
    ("sweep", pa.string()),
    ("drawing", pa.string()),  # SweepKind.drawing: layer_by_role, layer_by_head, none, trace_buckets, paths, atp
    ("row_shape", pa.string()),  # one of ROW_SHAPES
]), {"row_shape": ROW_SHAPES})


def row_shape(drawing: str) -> str:
    return DRAWING_SHAPES.get(drawing, "exact")


def sweep_kind_table(sweep_kinds: dict[str, str] | None) -> pa.Table:
    """{sweep: drawing} as the rows a load records (none: an empty table)."""
    return SWEEP_KIND.table([{"sweep": sweep, "drawing": drawing, "row_shape": row_shape(drawing)}
                             for sweep, drawing in (sweep_kinds or {}).items()])
