"""Named questions asked of the warehouse's views (the study's summary artifact, the demo's table)."""
from __future__ import annotations

from .loader import query


def strongest_effects(path, run_id: str, top: int = 20):
    """The run's largest mean recoveries (logit difference; trace aside), as (columns, rows)."""
    return query(path, """
        SELECT sweep, site, direction, layer, position_role, head, n_pairs,
               round(mean_recovery, 3) AS mean_recovery, round(ci95_low, 3) AS ci95_low,
               round(ci95_high, 3) AS ci95_high
        FROM effect_summary WHERE run_id = ? AND sweep <> 'trace'
        ORDER BY mean_recovery DESC NULLS LAST LIMIT ?""", [run_id, int(top)])


def stream_by_layer(path, run_id: str, every: int = 4):
    """Mean recovery of the resid stream (patched, and restored in causal tracing) at the last
    subject token and the last token, every `every`-th layer, as (columns, rows)."""
    return query(path, """
        SELECT sweep, site, direction, layer, position_role, head, n_pairs, round(mean_recovery, 3) AS mean_recovery,
               round(ci95_low, 3) AS ci95_low, round(ci95_high, 3) AS ci95_high
        FROM effect_summary WHERE run_id = ? AND sweep IN ('resid', 'trace') AND site = 'resid'
          AND direction = 'denoise' AND position_role IN ('subject_last', 'last') AND layer % ? = 0
        ORDER BY sweep, position_role DESC, layer""", [run_id, int(every)])
