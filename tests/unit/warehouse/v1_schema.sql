-- A schema-v1 warehouse (patchgrid 0.1.0 before the Parquet layout): every table inside one DuckDB
-- file. Kept to test the migration to v2 (warehouse/migrate.py).

CREATE TABLE IF NOT EXISTS patchgrid_schema (
    version INTEGER NOT NULL
);

-- One row per study run.
CREATE TABLE IF NOT EXISTS runs (
    run_id       VARCHAR PRIMARY KEY,
    flow_run_id  VARCHAR,
    model        VARCHAR NOT NULL,
    model_hash   VARCHAR,
    params       JSON,
    code_version VARCHAR,
    started      TIMESTAMP,
    finished     TIMESTAMP,
    status       VARCHAR NOT NULL  -- rows.RUN_STATUSES
);

-- Every input record of a run, accepted or rejected with its reason.
CREATE TABLE IF NOT EXISTS pairs (
    run_id         VARCHAR NOT NULL,
    pair_id        VARCHAR NOT NULL,
    relation       VARCHAR,
    clean_prompt   VARCHAR,
    corrupt_prompt VARCHAR,
    clean_answer   VARCHAR,
    corrupt_answer VARCHAR,
    status         VARCHAR NOT NULL,  -- accepted | rejected
    reason         VARCHAR,
    detail         VARCHAR,
    subject        VARCHAR,
    subject_start  INTEGER,
    subject_end    INTEGER,           -- exclusive
    roles          VARCHAR[],         -- one per position
    PRIMARY KEY (run_id, pair_id)
);

-- Unpatched runs of each accepted pair.
CREATE TABLE IF NOT EXISTS baselines (
    run_id             VARCHAR NOT NULL,
    pair_id            VARCHAR NOT NULL,
    clean_logit_diff   FLOAT,
    corrupt_logit_diff FLOAT,
    clean_p            FLOAT,
    corrupt_p          FLOAT,
    PRIMARY KEY (run_id, pair_id)
);

-- One row per (pair, patched site). `head` and "window" are NULL where they do not apply; a
-- patch over every position has position NULL and position_role 'all'; for trace, one row per
-- restored site averaged over the noise samples, with the noised run as the corrupt baseline.
CREATE TABLE IF NOT EXISTS effects (
    run_id             VARCHAR NOT NULL,
    pair_id            VARCHAR NOT NULL,
    relation           VARCHAR,           -- copied from pairs, so summaries need no join
    sweep              VARCHAR NOT NULL,  -- a sweep kind (patchgrid.sweeps.SWEEP_KINDS)
    site               VARCHAR NOT NULL,  -- a site kind (patchgrid.model.sites.SITES)
    direction          VARCHAR NOT NULL,  -- denoise | noise
    layer              INTEGER,
    position           INTEGER,
    position_role      VARCHAR NOT NULL,
    head               INTEGER,
    "window"           INTEGER,
    metric             VARCHAR NOT NULL,  -- what effect and recovery measure (patchgrid.metrics)
    patched_logit_diff FLOAT,
    patched_p          FLOAT,
    clean_logit_diff   FLOAT,
    corrupt_logit_diff FLOAT,
    clean_p            FLOAT,
    corrupt_p          FLOAT,
    effect             FLOAT,
    recovery           FLOAT
);

-- The views v1 created beside its tables.
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
