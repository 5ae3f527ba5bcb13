-- The interface dashboards read. Layered: a staging view averages each pair's rows per
-- position role (a pair may have several `further` positions), then summaries average pairs.

-- staging: one row per (run, pair, sweep, site, direction, layer, role, head, window)
CREATE OR REPLACE VIEW pair_effects AS
SELECT
    run_id, pair_id, relation, sweep, site, direction, layer, position_role, head, "window",
    avg(recovery) AS recovery,
    avg(effect)   AS effect
FROM effects
GROUP BY run_id, pair_id, relation, sweep, site, direction, layer, position_role, head, "window";

CREATE OR REPLACE VIEW effect_summary AS
SELECT
    run_id, sweep, site, direction, layer, position_role, head,
    count(DISTINCT pair_id)                                    AS n_pairs,
    avg(recovery)                                              AS mean_recovery,
    stddev_samp(recovery)                                      AS sd_recovery,
    stddev_samp(recovery) / sqrt(count(recovery))              AS se_recovery,
    avg(recovery) - 1.96 * stddev_samp(recovery) / sqrt(count(recovery)) AS ci95_low,
    avg(recovery) + 1.96 * stddev_samp(recovery) / sqrt(count(recovery)) AS ci95_high,
    avg(effect)                                                AS mean_effect,
    stddev_samp(effect)                                        AS sd_effect
FROM pair_effects
GROUP BY run_id, sweep, site, direction, layer, position_role, head;

CREATE OR REPLACE VIEW relation_summary AS
SELECT
    run_id, relation, sweep, site, direction, layer, position_role, head,
    count(DISTINCT pair_id)                                    AS n_pairs,
    avg(recovery)                                              AS mean_recovery,
    stddev_samp(recovery)                                      AS sd_recovery,
    stddev_samp(recovery) / sqrt(count(recovery))              AS se_recovery,
    avg(recovery) - 1.96 * stddev_samp(recovery) / sqrt(count(recovery)) AS ci95_low,
    avg(recovery) + 1.96 * stddev_samp(recovery) / sqrt(count(recovery)) AS ci95_high,
    avg(effect)                                                AS mean_effect,
    stddev_samp(effect)                                        AS sd_effect
FROM pair_effects
GROUP BY run_id, relation, sweep, site, direction, layer, position_role, head;

CREATE OR REPLACE VIEW rejections AS
SELECT run_id, reason, count(*) AS n
FROM pairs
WHERE status = 'rejected'
GROUP BY run_id, reason;

CREATE OR REPLACE VIEW run_overview AS
SELECT
    r.run_id, r.model, r.model_hash, r.params, r.code_version, r.started, r.finished, r.status,
    (SELECT count(*) FROM pairs p WHERE p.run_id = r.run_id)                             AS n_records,
    (SELECT count(*) FROM pairs p WHERE p.run_id = r.run_id AND p.status = 'accepted')   AS n_accepted,
    (SELECT count(*) FROM pairs p WHERE p.run_id = r.run_id AND p.status = 'rejected')   AS n_rejected,
    (SELECT count(*) FROM baselines b WHERE b.run_id = r.run_id)                         AS n_swept
FROM runs r;
