"""How activations lie in Arrow IPC files: one row per (pair, position), one column per site key,
each a fixed-size list of the site's width in the model's dtype (bfloat16 as its uint16 bit
pattern, since Arrow has no bfloat16); read back as tensors over the memory-mapped file."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..plan import LOGPROBS

if TYPE_CHECKING:  # imported where it is used: the light commands import the cache's package and need no torch
    import torch

# torch dtype's name -> (the Arrow type of its values, the numpy dtype of their bits)
ARROW_TYPES = {"bfloat16": (pa.uint16(), np.uint16), "float16": (pa.float16(), np.float16),
               "float32": (pa.float32(), np.float32)}


def arrow_types(dtype) -> tuple:
    """(the Arrow type, the numpy dtype of the bits) a torch dtype is stored as."""
    return ARROW_TYPES[str(dtype).removeprefix("torch.")]


def run_schema(keys, widths: dict[str, int], dtype) -> pa.Schema:
    """The schema of one run's file: pair_index, position, then a column per site key."""
    dtype_arrow, _ = arrow_types(dtype)
    fields = [pa.field("pair_index", pa.int32()), pa.field("position", pa.int32())]
    fields += [pa.field(k, pa.list_(dtype_arrow, widths[k])) for k in keys]
    return pa.schema(fields, metadata={"dtype": str(dtype)})


def record_batch(schema, keys, start, chunk, results, dtype) -> pa.RecordBatch:
    """The rows of a chunk of pairs (pair index `start` on) in one run: its results' captures."""
    import torch

    # a pair's rows: its prompt's positions, then its answers' inputs (plan.tree_len)
    rows = [len(r.captures[keys[0]]) if keys else len(p.clean_ids) for p, r in zip(chunk, results)]
    pair_index = np.concatenate([np.full(n, start + i, np.int32) for i, n in enumerate(rows)])
    position = np.concatenate([np.arange(n, dtype=np.int32) for n in rows])
    cols = [pa.array(pair_index), pa.array(position)]
    _, np_dtype = arrow_types(dtype)
    for key in keys:
        t = torch.cat([r.captures[key] for r in results]).to(dtype).contiguous()
        raw = t.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16 else t.numpy()
        cols.append(pa.FixedSizeListArray.from_arrays(pa.array(raw.reshape(-1).astype(np_dtype, copy=False)),
                                                      t.shape[1]))
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def logprobs_table(logprobs: list[torch.Tensor], vocab: int) -> pa.Table:
    """Per pair: the clean run's log-probabilities at its last prompt position, float32."""
    import torch

    lp = torch.stack(logprobs).float().numpy().reshape(-1) if logprobs else np.zeros(0, np.float32)
    return pa.table({"pair_index": pa.array(np.arange(len(logprobs), dtype=np.int32)),
                     LOGPROBS: pa.FixedSizeListArray.from_arrays(pa.array(lp), vocab)})


def write_table(path: Path, table: pa.Table) -> None:
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)


def read_ipc(path: Path) -> pa.Table:
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def tensor_rows(column: pa.FixedSizeListArray, row0: int, n: int, width: int, dtype) -> torch.Tensor:
    """Rows row0 .. row0 + n of a column as a [n, width] tensor over the mapped file (no copy)."""
    import torch

    values = column.values
    _, np_dtype = arrow_types(dtype)
    item = np.dtype(np_dtype).itemsize
    buf = values.buffers()[1]
    start = (values.offset + (column.offset + row0) * width) * item
    arr = np.frombuffer(buf, dtype=np_dtype, count=n * width, offset=start).reshape(n, width)
    with warnings.catch_warnings():
        # The mapped file is read-only; nothing writes to these tensors (engines copy what they send).
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
