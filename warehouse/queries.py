"""Named questions asked of the warehouse's views (the study's summary artifact, the demo's tables).
Each result names the metric its numbers are on (its `metric` column)."""
from __future__ import annotations

from patchgrid.metrics import METRICS
from patchgrid.rows.shapes import BASE_RUNS, POSITION_ROLES

from .loader import query

# The resid stream patched clean into corrupt, one (layer, position) per run: its exact rows (no
# sweep kind named: the only exact rows at the resid site that are not noised, views.sql)
RESID_STREAM = ("s.site = 'resid' AND s.direction = 'denoise' AND NOT EXISTS "
                "(SELECT 1 FROM noised_sweeps n WHERE n.run_id = s.run_id AND n.sweep = s.sweep)")

# The metric a question is asked on when none is named: logprob_diff, which every pair has (answers
# of any length) and which equals logit_diff for one-token answers; else logit_diff, for loads
# written before answers were scored.
DEFAULT_METRICS = ("logprob_diff", "logit_diff")


# The directions whose patch goes into the clean run (noising): there the patched run starts at the clean
# run's value, recovery 1 means the patch changed nothing and a strong patch moves the metric away.
_INTO_CLEAN = "direction IN (" + ", ".join(f"'{d}'" for d, run in BASE_RUNS.items() if run == "clean") + ")"


def strength_sql(by_recovery: str, recovery: str = "mean_recovery", effect: str = "mean_effect",
                 better: str = "better") -> str:
    """SQL for how strongly a cell's patch moved its metric, larger the stronger in either direction:
    where `by_recovery` holds, a denoising patch's mean recovery (1: the clean run's value restored) and a
    noising patch's 1 - mean recovery (0: the patch changed nothing); else the mean effect (patched -
    the run patched into) toward the clean run's value for denoising, away from it for noising, in the
    metric's `better` direction. Over effect_summary's columns and the metric's `better`."""
    return (f"CASE WHEN {by_recovery} THEN CASE WHEN {_INTO_CLEAN} THEN 1 - {recovery} ELSE {recovery} END "
            f"ELSE CASE WHEN {_INTO_CLEAN} THEN -1 ELSE 1 END * {better} * {effect} END")


def ranked_by_sql(by_recovery: str) -> str:
    """SQL naming what strength_sql(by_recovery) ranks a cell by, in words a summary prints."""
    return (f"CASE WHEN {by_recovery} THEN CASE WHEN {_INTO_CLEAN} THEN '1 - recovery' ELSE 'recovery' END "
            f"ELSE CASE WHEN {_INTO_CLEAN} THEN 'effect away from clean' ELSE 'effect toward clean' END END")


def _metric_sql(metric: str | None, run_id: str) -> tuple[str, list]:
    """SQL for the metric a question on `run_id` is on, and its parameters."""
    if metric is not None:
        if metric not in METRICS:
            raise ValueError(f"metric {metric!r} is not one of {', '.join(METRICS)}")
        return "?", [metric]
    first, fallback = DEFAULT_METRICS
    # `effects` rather than a summary: the first row with a value answers, no aggregate is computed
    return (f"(SELECT CASE WHEN EXISTS (SELECT 1 FROM effects WHERE run_id = ? AND patched_{first} IS NOT NULL) "
            f"THEN '{first}' ELSE '{fallback}' END)"), [run_id]


def strongest_effects(path, run_id: str, top: int = 20, metric: str | None = None):
    """The run's cells whose patch moved `metric` most (strength_sql: denoising by mean recovery, noising
    by 1 - mean recovery; for a metric without recovery, rank, by the mean effect toward or away from the
    clean run's value), as (columns, rows), `ranked_by` naming which. metric None: logprob_diff where the
    run has it, else logit_diff."""
    chosen, params = _metric_sql(metric, run_id)
    by_recovery = "m.min_span IS NOT NULL"
    return query(path, f"""
        SELECT s.sweep, s.site, s.direction, s.layer, s.position_role, s.head, s.sender, s.receiver, s.metric,
               s.n_pairs, s.n_recovery,
               round(s.mean_effect, 3) AS mean_effect, round(s.mean_recovery, 3) AS mean_recovery,
               round(s.ci95_low, 3) AS ci95_low, round(s.ci95_high, 3) AS ci95_high,
               {ranked_by_sql(by_recovery)} AS ranked_by
        FROM effect_summary s JOIN metrics m USING (metric)
        WHERE s.run_id = ? AND s.metric = {chosen}
        ORDER BY {strength_sql(by_recovery, "s.mean_recovery", "s.mean_effect", "m.better")} DESC NULLS LAST
        LIMIT ?""", [run_id, *params, int(top)])


def stream_by_layer(path, run_id: str, every: int = 4, metric: str | None = None):
    """Mean recovery on `metric` when the resid stream is patched clean into corrupt, at the last
    subject token and the last token, every `every`-th layer, as (columns, rows). metric None:
    logprob_diff where the run has it, else logit_diff (rank has no recovery: its mean_effect is
    in effect_summary)."""
    chosen, params = _metric_sql(metric, run_id)
    return query(path, f"""
        SELECT layer, position_role, metric, n_recovery, round(mean_recovery, 3) AS mean_recovery,
               round(ci95_low, 3) AS ci95_low, round(ci95_high, 3) AS ci95_high
        FROM effect_summary s WHERE run_id = ? AND metric = {chosen} AND {RESID_STREAM}
          AND position_role IN ('subject_last', 'last') AND layer % ? = 0
        ORDER BY position_role DESC, layer""", [run_id, *params, int(every)])


def every_metric(path, run_id: str, layers: tuple[int, ...], roles=("subject_last", "last")):
    """Every metric side by side for the resid stream patched clean into corrupt at `layers` and
    `roles`: mean effect and mean recovery with the pairs behind each, as (columns, rows)."""
    marks = ", ".join("?" for _ in layers)
    roles_in = ", ".join("?" for _ in roles)
    return query(path, f"""
        SELECT s.layer, s.position_role, s.metric, s.n_pairs, round(s.mean_effect, 3) AS mean_effect,
               s.n_recovery, round(s.mean_recovery, 3) AS mean_recovery, round(s.ci95_low, 3) AS ci95_low,
               round(s.ci95_high, 3) AS ci95_high
        FROM effect_summary s JOIN metrics m USING (metric)
        WHERE s.run_id = ? AND {RESID_STREAM} AND s.layer IN ({marks})
          AND s.position_role IN ({roles_in})
        ORDER BY s.position_role DESC, s.layer, list_position(?, s.metric)""",
                 [run_id, *layers, *roles, list(METRICS)])


def trace_by_bucket(path, run_id: str, every: int = 4):
    """Causal tracing's average indirect effect on p(answer) of restoring the hidden state, in Meng et
    al.'s last-subject-token, first-subsequent-token and last-token buckets, every `every`-th layer, as
    (columns, rows)."""
    return query(path, """
        SELECT layer, bucket, metric, n_prompts, n_tokens, round(aie, 3) + 0 AS aie,
               round(ci95_low, 3) + 0 AS ci95_low, round(ci95_high, 3) + 0 AS ci95_high,
               round(mean_noised, 3) AS noised_p
        FROM trace_buckets WHERE run_id = ? AND metric = 'p' AND site = 'resid'
          AND bucket IN ('last_subject', 'first_subsequent', 'last') AND layer % ? = 0
        ORDER BY list_position(['last_subject', 'first_subsequent', 'last'], bucket), layer""", [run_id, int(every)])


# A sender's place in a path matrix: by layer, attention (its heads, then attn_out) before the MLP.
PATH_SENDER_SITES = ("head", "attn_out", "mlp_out")


def path_matrix(path, run_id: str, metric: str | None = None, position_role: str | None = None):
    """The run's path-patching matrix (path_summary): one row per (sender, receiver) cell at each
    position role (or only `position_role`; `all`: every position at once), with the mean effect of
    patching the sender clean into corrupt along that one path (patched − corrupt on `metric`), its
    t interval, the mean recovery and the pairs behind it, as (columns, rows). Senders in order of
    layer (heads by head, then attn_out, then mlp_out), receivers `logits` first then by layer,
    head and input (q, k, v). metric None: logprob_diff where the run has it, else logit_diff."""
    chosen, params = _metric_sql(metric, run_id)
    where_role = "" if position_role is None else " AND position_role = ?"
    return query(path, f"""
        SELECT position_role, sender, receiver, metric, sender_site, sender_layer, sender_head, receiver_input,
               receiver_layer, receiver_head, n_pairs, round(mean_effect, 3) AS mean_effect,
               round(effect_ci95_low, 3) AS effect_ci95_low, round(effect_ci95_high, 3) AS effect_ci95_high,
               n_recovery, round(mean_recovery, 3) AS mean_recovery, round(ci95_low, 3) AS ci95_low,
               round(ci95_high, 3) AS ci95_high
        FROM path_summary WHERE run_id = ? AND metric = {chosen}{where_role}
        ORDER BY list_position(?, position_role), sender_layer, list_position(?, sender_site),
                 sender_head NULLS FIRST, receiver <> 'logits', receiver_layer, receiver_head,
                 list_position(['q', 'k', 'v'], receiver_input)""",
                 [run_id, *params, *([] if position_role is None else [position_role]), list(POSITION_ROLES),
                  list(PATH_SENDER_SITES)])
