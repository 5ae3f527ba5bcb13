"""Per-pair effect rows as an Arrow table (the sweeps' output, the warehouse's input)."""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema([
    ("pair_id", pa.string()),
    ("relation", pa.string()),
    ("sweep", pa.string()),  # resid | attn_out | mlp_out | heads | trace
    ("site", pa.string()),  # resid | attn_out | mlp_out | head
    ("direction", pa.string()),  # denoise (clean into corrupt) | noise (corrupt into clean)
    ("layer", pa.int32()),  # the window's centre for windowed trace rows
    ("position", pa.int32()),  # null: every position at once
    ("position_role", pa.string()),  # a pairs-table role, or `all`
    ("head", pa.int32()),
    ("window", pa.int32()),
    ("metric", pa.string()),  # what effect and recovery measure: logit_diff or p
    ("patched_logit_diff", pa.float32()),
    ("patched_p", pa.float32()),
    ("clean_logit_diff", pa.float32()),
    ("corrupt_logit_diff", pa.float32()),  # trace: the noised run's
    ("clean_p", pa.float32()),
    ("corrupt_p", pa.float32()),  # trace: the noised run's
    ("effect", pa.float32()),
    ("recovery", pa.float32()),
])


def to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def write_effects(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(to_table(rows), tmp)
    os.replace(tmp, path)
    return path
