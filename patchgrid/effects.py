"""Per-pair effect rows (the sweeps' output, the warehouse's input), in the `rows.EFFECT` shape."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from .metrics import Reading, recovery
from .rows import EFFECT
from .staging import write_parquet

SCHEMA = EFFECT.schema


def effect_row(pair, cell, patched: Reading, clean: Reading, corrupt: Reading, metric: str) -> dict:
    """One effect row: the patched run's reading beside the pair's baselines, and the effect and
    recovery on `metric`. Denoising is measured from the corrupt run, noising from the clean run."""
    reference = clean if cell.direction == "noise" else corrupt
    value = patched.value(metric)
    return {
        "pair_id": pair.pair_id, "relation": pair.relation, "sweep": cell.sweep, "site": cell.site,
        "direction": cell.direction, "layer": cell.layer, "position": cell.position,
        "position_role": "all" if cell.position is None else pair.roles[cell.position],
        "head": cell.head, "window": cell.window, "metric": metric,
        "patched_logit_diff": patched.logit_diff, "patched_p": patched.p,
        "clean_logit_diff": clean.logit_diff, "corrupt_logit_diff": corrupt.logit_diff,
        "clean_p": clean.p, "corrupt_p": corrupt.p,
        "effect": value - reference.value(metric),
        "recovery": recovery(value, clean.value(metric), corrupt.value(metric)),
    }


def to_table(rows: list[dict]) -> pa.Table:
    return EFFECT.table(rows)


def write_effects(rows: list[dict], path: str | Path) -> Path:
    return write_parquet(to_table(rows), path)
