"""The pairs table as Parquet: one row per input record, in the `rows.PAIR` shape."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..rows.shapes import PAIR
from ..rows.staging import write_parquet

SCHEMA = PAIR.schema


def to_table(rows: list[dict]) -> pa.Table:
    return PAIR.table(rows)


def write_pairs(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # a missing output folder is made
    return write_parquet(to_table(rows), path)


def read_pairs(path: str | Path) -> pa.Table:
    return pq.read_table(path, schema=SCHEMA)
