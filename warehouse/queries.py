"""Named questions asked of the warehouse's views (the study's summary artifact, the demo's tables).
Each result names the metric its numbers are on."""
from __future__ import annotations

from .loader import query


def strongest_effects(path, run_id: str, top: int = 20):
    """The run's largest mean recoveries of logit difference (patching sweeps), as (columns, rows)."""
    return query(path, """
        SELECT sweep, site, direction, layer, position_role, head, metric, n_recovery,
               round(mean_recovery, 3) AS mean_recovery, round(ci95_low, 3) AS ci95_low,
               round(ci95_high, 3) AS ci95_high
        FROM effect_summary WHERE run_id = ? AND metric = 'logit_diff'
        ORDER BY mean_recovery DESC NULLS LAST LIMIT ?""", [run_id, int(top)])


def stream_by_layer(path, run_id: str, every: int = 4):
    """Mean recovery of logit difference when the resid stream is patched clean into corrupt, at the
    last subject token and the last token, every `every`-th layer, as (columns, rows)."""
    return query(path, """
        SELECT layer, position_role, metric, n_recovery, round(mean_recovery, 3) AS mean_recovery,
               round(ci95_low, 3) AS ci95_low, round(ci95_high, 3) AS ci95_high
        FROM effect_summary WHERE run_id = ? AND sweep = 'resid' AND direction = 'denoise'
          AND position_role IN ('subject_last', 'last') AND layer % ? = 0
        ORDER BY position_role DESC, layer""", [run_id, int(every)])


def trace_by_bucket(path, run_id: str, every: int = 4):
    """Causal tracing's average indirect effect on p(answer) of restoring the hidden state, in Meng et
    al.'s last-subject-token and last-token buckets, every `every`-th layer, as (columns, rows)."""
    return query(path, """
        SELECT layer, bucket, metric, n_prompts, round(aie, 3) + 0 AS aie, round(ci95_low, 3) + 0 AS ci95_low,
               round(ci95_high, 3) + 0 AS ci95_high, round(mean_noised_p, 3) AS noised_p
        FROM trace_buckets WHERE run_id = ? AND site = 'resid' AND bucket IN ('last_subject', 'last')
          AND layer % ? = 0
        ORDER BY bucket DESC, layer""", [run_id, int(every)])
