"""Per-pair effect rows (the sweeps' output, the warehouse's input), in the `rows.EFFECT` shape."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pyarrow as pa

from ..metrics import Reading, recovery
from ..model.sites import unit_name
from .shapes import BASE_RUNS, EFFECT
from .staging import write_parquet

SCHEMA = EFFECT.schema


READING_FIELDS = tuple(f.name for f in fields(Reading))
_COLUMNS = {prefix: tuple(f"{prefix}_{name}" for name in READING_FIELDS) for prefix in ("patched", "clean", "corrupt")}


def reading_columns(prefix: str, reading: Reading | None) -> dict:
    """A reading as row columns: `<prefix>_<metric>` for every metric, and the per-token lists
    (NULL for a run that was not made)."""
    columns = _COLUMNS.get(prefix) or tuple(f"{prefix}_{name}" for name in READING_FIELDS)
    if reading is None:
        return dict.fromkeys(columns)
    return dict(zip(columns, vars(reading).values()))  # a Reading's fields, in READING_FIELDS' order


def reading_from(row: dict, prefix: str) -> Reading:
    """The reading a row holds under `prefix` (reading_columns' inverse)."""
    return Reading(**{name: row[f"{prefix}_{name}"] for name in READING_FIELDS})


def cell_columns(pair, cell) -> dict:
    """The columns of an effect row that say which pair and cell it is (the cell's own row columns
    among them: a circuit's size, a knockout's group)."""
    row = {
        "pair_id": pair.pair_id, "relation": pair.relation, "sweep": cell.sweep, "site": cell.site,
        "direction": cell.direction, "layer": cell.layer, "position": cell.position,
        "position_role": "all" if cell.position is None else pair.roles[cell.position],
        "head": cell.head, "neuron": cell.neuron, "window": cell.window,
        "sender": None if cell.receiver is None else unit_name(cell.site, cell.layer, cell.head),
        "receiver": cell.receiver,
    }
    if cell.row_columns:
        row.update(cell.row_columns)
    return row


def baseline_columns(clean: Reading, corrupt: Reading) -> dict:
    """The clean and corrupt runs' columns of every effect row of a pair."""
    return {**reading_columns("clean", clean), **reading_columns("corrupt", corrupt)}


class PairRows:
    """The effect rows of one pair's cells (a grid makes one per run): the patched run's reading
    beside the pair's baselines, on every metric, and the effect and recovery on the headline
    `metric`, measured from the run the row's direction goes into (shapes.BASE_RUNS: denoising from
    the corrupt run, noising and knockouts from the clean run). What every row of the pair shares (its
    baselines' columns and values) is made once."""

    def __init__(self, pair, clean: Reading, corrupt: Reading, metric: str):
        self.pair, self.metric = pair, metric
        self.base = baseline_columns(clean, corrupt)
        self.clean_value, self.corrupt_value = clean.value(metric), corrupt.value(metric)

    def row(self, cell, patched: Reading | None) -> dict:
        """`cell`'s row; `patched` None: a site estimated but not patched (atp)."""
        value = None if patched is None else getattr(patched, self.metric)
        clean, corrupt = self.clean_value, self.corrupt_value
        ref = clean if BASE_RUNS[cell.direction] == "clean" else corrupt
        row = cell_columns(self.pair, cell)  # the row grows in place
        row["metric"] = self.metric
        row["effect"] = None if value is None or ref is None else value - ref
        row["recovery"] = recovery(value, clean, corrupt)
        if patched is None:
            row.update(dict.fromkeys(_COLUMNS["patched"]))
        else:
            row.update(zip(_COLUMNS["patched"], vars(patched).values()))  # a Reading's fields, in READING_FIELDS' order
        row.update(self.base)
        return row


def effect_row(pair, cell, patched: Reading | None, clean: Reading, corrupt: Reading, metric: str) -> dict:
    """One effect row (PairRows.row), for a cell whose pair makes no other."""
    return PairRows(pair, clean, corrupt, metric).row(cell, patched)


def to_table(rows: list[dict]) -> pa.Table:
    return EFFECT.table(rows)


def write_effects(rows: list[dict], path: str | Path) -> Path:
    return write_parquet(to_table(rows), path)
