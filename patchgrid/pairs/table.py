"""The pairs table as Parquet: one row per input record."""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema([
    ("pair_id", pa.string()),
    ("source_line", pa.int64()),
    ("relation", pa.string()),
    ("status", pa.string()),  # accepted | rejected
    ("reason", pa.string()),  # a reason code when rejected
    ("detail", pa.string()),  # the reason in words
    ("subject", pa.string()),
    ("corrupt_subject", pa.string()),
    ("clean_prompt", pa.string()),
    ("corrupt_prompt", pa.string()),
    ("clean_answer", pa.string()),
    ("corrupt_answer", pa.string()),
    ("clean_ids", pa.list_(pa.int32())),
    ("corrupt_ids", pa.list_(pa.int32())),
    ("clean_answer_id", pa.int32()),
    ("corrupt_answer_id", pa.int32()),
    ("answer_policy", pa.string()),  # single | first-token
    ("subject_start", pa.int32()),
    ("subject_end", pa.int32()),  # exclusive
    ("roles", pa.list_(pa.string())),  # one per position
    ("clean_logit_diff", pa.float32()),  # set by --require-known
    ("corrupt_logit_diff", pa.float32()),
    ("usable_alone", pa.bool_()),  # the clean fact alone passes, for causal tracing
    ("known_alone", pa.bool_()),  # the model's top token on the clean prompt is the answer
])


def to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def write_pairs(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise ValueError(f"--out {path}: folder {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(to_table(rows), tmp)
    os.replace(tmp, path)  # never a half-written table under the real name
    return path


def read_pairs(path: str | Path) -> pa.Table:
    return pq.read_table(path, schema=SCHEMA)
