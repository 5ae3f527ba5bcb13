"""The warehouse: schema versioning, idempotent atomic loads, views, read-only queries, migration."""
from __future__ import annotations

import math
import multiprocessing as mp
import random
import statistics

import duckdb
import pytest

from patchgrid.pairs import to_table as pairs_table
from patchgrid.rows.effects import write_effects
from patchgrid.warehouse.layout import Layout
from patchgrid.warehouse.loader import SCHEMA_VERSION, WarehouseError, ensure, load_run, query, start_run
from tests.support.effect_rows import CLEAN, CORRUPT, baseline, make_pair, row, shifted

ROLES = ["subject_first", "subject_last", "further", "further", "last"]
# The effect and baseline columns patchgrid wrote before every metric had its own (schema v1, and
# the v2 loads made before the per-metric columns): logit difference and p only.
OLD_EFFECT_COLUMNS = ["pair_id", "relation", "sweep", "site", "direction", "layer", "position", "position_role", "head",
                      "window", "metric", "patched_logit_diff", "patched_p", "clean_logit_diff", "corrupt_logit_diff",
                      "clean_p", "corrupt_p", "effect", "recovery"]
OLD_BASELINE_COLUMNS = ["pair_id", "clean_logit_diff", "corrupt_logit_diff", "clean_p", "corrupt_p"]


def synthetic(n_pairs=6, seed=0, relations=("capital", "currency"), multi_token=False):
    """Pairs, baselines and resid rows; `multi_token`: answers scored whole, so no logit difference."""
    rng = random.Random(seed)
    clean, corrupt = (shifted(r, logit_diff=None) if multi_token else r for r in (CLEAN, CORRUPT))
    headline = "logprob_diff" if multi_token else "logit_diff"
    pairs, baselines, effects = [], [], []
    for i in range(n_pairs):
        pid = f"p{i}"
        rel = relations[i % len(relations)]
        pairs.append({"pair_id": pid, "relation": rel, "status": "accepted", "clean_prompt": "a b c d e",
                      "corrupt_prompt": "a x c d e", "clean_answer": " y", "corrupt_answer": " z",
                      "subject": "b", "subject_start": 1, "subject_end": 2, "roles": ROLES,
                      "clean_ids": [1, 2, 3, 4, 5], "corrupt_ids": [1, 9, 3, 4, 5], "clean_answer_id": 7,
                      "corrupt_answer_id": 8})
        baselines.append(baseline(pid, clean, corrupt))
        key = make_pair(pid, ROLES, rel, subject=(1, 2))
        for layer in range(3):
            for pos in range(len(ROLES)):
                effects.append(row(key, rng.uniform(-0.2, 1.2), layer=layer, position=pos, metric=headline,
                                   clean=clean, corrupt=corrupt))
    pairs.append({"pair_id": "bad", "relation": "capital", "status": "rejected", "reason": "no_partner"})
    return pairs_table(pairs), baselines, effects


def load(tmp_path, wh, run_id="run-a", seed=0, **kw):
    """The synthetic run loaded as a study loads it; returns the counts and the effect rows."""
    pairs, baselines, effects = synthetic(seed=seed, **kw)
    f = write_effects(effects, tmp_path / f"{run_id}-{seed}.parquet")
    start_run(wh, {"run_id": run_id, "model": "m", "params": {"x": 1}})
    return load_run(wh, run_id, pairs, baselines, [f]), effects


def count(wh, table, run_id=None):
    sql = f"SELECT count(*) FROM {table}" + (" WHERE run_id = ?" if run_id else "")
    return query(wh, sql, [run_id] if run_id else None)[1][0][0]


def test_schema_applied_and_versioned(tmp_path):
    wh = tmp_path / "w.duckdb"
    layout = ensure(wh)
    assert layout.version() == SCHEMA_VERSION
    con = duckdb.connect(str(wh), read_only=True)  # as a dashboard opens it
    views = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    assert {"runs", "pairs", "baselines", "effects", "effect_summary", "relation_summary", "rejections"} <= views
    assert con.execute("SELECT count(*) FROM effects").fetchone() == (0,)
    con.close()
    mtime = wh.stat().st_mtime_ns
    ensure(wh)  # opening again rewrites nothing
    assert wh.stat().st_mtime_ns == mtime


def test_load_is_idempotent_and_runs_coexist(tmp_path):
    wh = tmp_path / "w.duckdb"
    counts, effects = load(tmp_path, wh)
    assert counts == {"pairs": 7, "baselines": 6, "effects": len(effects)}
    load(tmp_path, wh)
    assert count(wh, "effects") == len(effects) and count(wh, "pairs") == 7 and count(wh, "runs") == 1
    load(tmp_path, wh, run_id="run-b", seed=1)
    assert count(wh, "effects", "run-a") == len(effects) and count(wh, "effects", "run-b") == len(effects)
    assert query(wh, "SELECT status FROM runs WHERE run_id = 'run-a'")[1] == [("completed",)]


def test_a_failed_load_leaves_the_warehouse_as_it_was(tmp_path):
    wh = tmp_path / "w.duckdb"
    _, effects = load(tmp_path, wh)
    pairs, baselines, _ = synthetic(seed=5)
    with pytest.raises(OSError):
        load_run(wh, "run-a", pairs, baselines, [tmp_path / "run-a-0.parquet", tmp_path / "missing.parquet"])
    assert count(wh, "effects") == len(effects) and count(wh, "baselines") == 6


def test_effect_summary_matches_a_direct_computation(tmp_path):
    wh = tmp_path / "w.duckdb"
    _, effects = load(tmp_path, wh)
    # per pair, average its rows of a role first (two `further` positions), then across pairs
    per_pair = {}
    for e in effects:
        if e["layer"] == 1 and e["position_role"] == "further":
            per_pair.setdefault(e["pair_id"], []).append(e["recovery"])
    values = [statistics.mean(v) for v in per_pair.values()]
    cols, rows = query(wh, """SELECT n_pairs, n_recovery, metric, mean_recovery, sd_recovery, se_recovery, ci95_low,
                              ci95_high FROM effect_summary
                              WHERE run_id = 'run-a' AND layer = 1 AND position_role = 'further'
                              AND metric = 'logit_diff'""")
    n, n_rec, metric, mean, sd, se, lo, hi = rows[0]
    assert n == n_rec == 6 and metric == "logit_diff"
    assert mean == pytest.approx(statistics.mean(values), rel=1e-5)
    assert sd == pytest.approx(statistics.stdev(values), rel=1e-4)
    # Student's t on 5 degrees of freedom, not 1.96
    assert se == pytest.approx(sd / math.sqrt(6)) and lo == pytest.approx(mean - 2.5706 * se, rel=1e-4)
    assert hi == pytest.approx(mean + 2.5706 * se, rel=1e-4)
    rel = query(wh, "SELECT relation, n_pairs FROM relation_summary WHERE layer = 1 AND position_role = 'last' "
                    "AND metric = 'logit_diff' ORDER BY relation")[1]
    assert rel == [("capital", 3), ("currency", 3)]
    assert query(wh, "SELECT run_id, reason, n FROM rejections")[1] == [("run-a", "no_partner", 1)]


def test_views_unique_and_not_null(tmp_path):
    """dbt-style tests: each view's rows unique on its key; keys, counts and means never null."""
    from patchgrid.metrics import METRICS

    wh = tmp_path / "w.duckdb"
    _, effects = load(tmp_path, wh)
    for view, key, required in (
            ("metrics", "metric", "metric, meaning, better"),
            ("effect_metrics", "run_id, pair_id, sweep, site, direction, layer, position, head, neuron, \"window\", "
             "metric",
             "metric, patched, clean, corrupt, effect, moved, span"),
            ("pair_effects", "run_id, pair_id, sweep, site, direction, metric, layer, position_role, head, neuron, "
             "\"window\"",
             "metric, effect"),
            ("effect_summary", "run_id, sweep, site, direction, metric, layer, position_role, head, neuron",
             "n_pairs, metric, mean_effect"),
            ("relation_summary", "run_id, relation, sweep, site, direction, metric, layer, position_role, head, "
             "neuron",
             "n_pairs, metric, mean_effect")):
        dup = query(wh, f"SELECT count(*) FROM (SELECT {key}, count(*) c FROM {view} GROUP BY ALL HAVING c > 1)")[1]
        assert dup == [(0,)], view
        nulls = " OR ".join(f"{c.strip()} IS NULL" for c in required.split(","))
        assert query(wh, f"SELECT count(*) FROM {view} WHERE {nulls}")[1] == [(0,)], view
    # every effect row once per metric (these rows have every metric), and every metric summarised
    assert count(wh, "effect_metrics") == len(effects) * len(METRICS)
    assert {m for (m,) in query(wh, "SELECT DISTINCT metric FROM effect_summary")[1]} == set(METRICS)
    # the pairs behind each mean are the ones counted; a metric without recovery counts none
    assert query(wh, "SELECT count(*) FROM effect_summary JOIN metrics USING (metric) WHERE min_span IS NOT NULL "
                     "AND n_recovery + n_small_span <> n_pairs")[1] == [(0,)]
    assert query(wh, "SELECT count(*) FROM effect_summary JOIN metrics USING (metric) WHERE min_span IS NULL "
                     "AND (n_recovery, n_small_span) <> (0, 0) OR mean_recovery IS NOT NULL AND n_recovery = 0"
                     )[1] == [(0,)]


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_text("not a database"), "is not a DuckDB file"),
    (lambda p: p.mkdir(), "is a folder"),
    (lambda p: duckdb.connect(str(p)).execute("CREATE TABLE t (x INT)").close(), "not a patchgrid warehouse"),
])
def test_bad_warehouse_files(tmp_path, make, message):
    wh = tmp_path / "w.duckdb"
    make(wh)
    with pytest.raises(WarehouseError, match=message):
        ensure(wh)


def test_newer_schema_is_refused(tmp_path):
    wh = tmp_path / "w.duckdb"
    ensure(wh).version_file.write_text(f'{{"schema": {SCHEMA_VERSION + 1}}}')
    for use in (ensure, lambda p: query(p, "SELECT 1")):
        with pytest.raises(WarehouseError, match=f"newer patchgrid \\(schema v{SCHEMA_VERSION + 1}"):
            use(wh)


def test_query_cannot_change_the_warehouse(tmp_path):
    wh = tmp_path / "w.duckdb"
    _, effects = load(tmp_path, wh)
    for sql in ("DELETE FROM effects", "DROP TABLE runs",
                "INSERT INTO runs (run_id, model, status) VALUES ('x','y','z')", "CREATE TABLE t (x INT)"):
        with pytest.raises(WarehouseError, match="read-only"):
            query(wh, sql)
    assert count(wh, "effects") == len(effects)
    with pytest.raises(WarehouseError, match="does not exist"):
        query(tmp_path / "none.duckdb", "SELECT 1")


def _writer(args):
    path, run_id, seed, folder = args
    from pathlib import Path

    _, effects = load(Path(folder), path, run_id=run_id, seed=seed)
    return len(effects)


def test_concurrent_writers_queue_without_lock_errors(tmp_path):
    wh = str(tmp_path / "w.duckdb")
    with mp.get_context("spawn").Pool(3) as pool:
        sizes = pool.map(_writer, [(wh, f"run-{i}", i, str(tmp_path)) for i in range(3)])
    for i, n in enumerate(sizes):
        assert count(wh, "effects", f"run-{i}") == n


def _v1_warehouse(tmp_path, wh):
    """A schema-v1 file (tables inside DuckDB) holding the synthetic run, as patchgrid 0.1.0 wrote it."""
    from pathlib import Path

    pairs, baselines, effects = synthetic()
    con = duckdb.connect(str(wh))
    con.execute((Path(__file__).parent / "v1_schema.sql").read_text())
    con.execute("INSERT INTO patchgrid_schema VALUES (1)")
    con.execute("""INSERT INTO runs VALUES ('run-old', '', 'm', 'sha', '{"x": 1}', '0.1.0', TIMESTAMP '2026-01-01',
                   TIMESTAMP '2026-01-02', 'completed')""")
    con.register("p", pairs)
    con.execute("""INSERT INTO pairs BY NAME SELECT 'run-old' AS run_id, pair_id, relation, clean_prompt,
                   corrupt_prompt, clean_answer, corrupt_answer, status, reason, detail, subject, subject_start,
                   subject_end, roles FROM p""")
    import pyarrow as pa

    con.register("b", pa.Table.from_pylist(baselines).select(OLD_BASELINE_COLUMNS))
    con.execute("INSERT INTO baselines BY NAME SELECT 'run-old' AS run_id, * FROM b")
    con.register("e", write_and_read(effects, tmp_path).select(OLD_EFFECT_COLUMNS))
    con.execute("INSERT INTO effects BY NAME SELECT 'run-old' AS run_id, * FROM e")
    con.close()
    return len(effects)


def write_and_read(effects, tmp_path):
    import pyarrow.parquet as pq

    return pq.read_table(write_effects(effects, tmp_path / "v1-effects.parquet"))


def test_a_v1_warehouse_is_read_and_then_migrated(tmp_path, capsys):
    wh = tmp_path / "w.duckdb"
    n = _v1_warehouse(tmp_path, wh)
    summary = "SELECT layer, position_role, n_pairs, mean_recovery FROM effect_summary ORDER BY ALL"
    before = query(wh, summary)[1]
    assert count(wh, "effects") == n  # read as it is, before any writer migrates it

    load(tmp_path, wh, run_id="run-new")  # a writer migrates it, with a message
    message = capsys.readouterr().err
    assert "migrated from schema v1 to v2 (1 runs, 90 effect rows" in message
    assert (tmp_path / "w.v1.duckdb").exists()
    old = query(wh, "SELECT layer, position_role, n_pairs, mean_recovery FROM effect_summary WHERE run_id = 'run-old' "
                    "AND metric = 'logit_diff' ORDER BY ALL")[1]
    # v1 averaged its stored recoveries, the views now recompute them from the readings (float32)
    assert [r[:3] for r in old] == [r[:3] for r in before]
    assert [r[3] for r in old] == pytest.approx([r[3] for r in before], rel=1e-5)
    # v1 had logit difference and p only: the migrated run is summarised on those two
    assert query(wh, "SELECT DISTINCT metric FROM effect_summary WHERE run_id = 'run-old' ORDER BY 1")[1] == [
        ("logit_diff",), ("p",)]
    assert query(wh, "SELECT run_id, status, params->>'x' FROM runs ORDER BY run_id")[1] == [
        ("run-new", "completed", "1"), ("run-old", "completed", "1")]
    assert count(wh, "pairs", "run-old") == 7 and count(wh, "baselines", "run-old") == 6


def test_a_reader_snapshot_never_sees_half_a_load(tmp_path):
    """A connection's view of the warehouse is fixed when it opens; a new connection sees the new load."""
    from patchgrid.warehouse.loader import connect

    wh = tmp_path / "w.duckdb"
    _, effects = load(tmp_path, wh)
    con = connect(wh)
    try:
        first = con.execute("SELECT sum(recovery) FROM effects").fetchone()
        load(tmp_path, wh, seed=3)  # a rerun of the same run id with other numbers
        load(tmp_path, wh, run_id="run-b", seed=4)
        assert con.execute("SELECT sum(recovery) FROM effects").fetchone() == first
        assert con.execute("SELECT count(DISTINCT run_id) FROM effects").fetchone() == (1,)
    finally:
        con.close()
    assert query(wh, "SELECT sum(recovery) FROM effects WHERE run_id = 'run-a'")[1][0] != first
    assert count(wh, "effects", "run-a") == len(effects) and count(wh, "effects", "run-b") == len(effects)
    assert len(Layout.of(wh).loads("run-a")) == 2  # the superseded load stays for readers a while


def test_superseded_loads_are_removed_after_the_grace_period(tmp_path):
    import time

    from patchgrid.warehouse.layout import SUPERSEDED_GRACE_S, remove_superseded

    wh = tmp_path / "w.duckdb"
    for seed in range(3):
        load(tmp_path, wh, seed=seed)
    layout = Layout.of(wh)
    assert len(layout.loads("run-a")) == 3
    assert remove_superseded(layout, "run-a", now_ns=time.time_ns() + int(2 * SUPERSEDED_GRACE_S * 1e9)) == 2
    assert len(layout.loads("run-a")) == 1 and count(wh, "effects") == 90


def test_run_states(tmp_path):
    from patchgrid.warehouse.loader import finish_run

    wh = tmp_path / "w.duckdb"
    start_run(wh, {"run_id": "r1", "model": "m", "params": {"x": 1}})
    finish_run(wh, "r1", "failed", reason="ValueError: no accepted pairs")
    start_run(wh, {"run_id": "r2", "model": "m"})
    finish_run(wh, "r2", "cancelled", reason="SIGTERM")
    assert query(wh, "SELECT run_id, model, status, reason, params->>'x' FROM runs ORDER BY run_id")[1] == [
        ("r1", "m", "failed", "ValueError: no accepted pairs", "1"), ("r2", "m", "cancelled", "SIGTERM", None)]
    with pytest.raises(ValueError, match="does not end a run"):
        finish_run(wh, "r1", "running")


def _old_shaped_load(wh, run_id: str, seed=0) -> None:
    """The synthetic run in a warehouse of schema v2 (migrated by the next patchgrid to open it), as
    patchgrid wrote loads before every metric had its columns: effect and baseline files with logit
    difference and p only, pairs without answer_policy, no record of its kinds."""
    import pyarrow as pa

    from tests.unit.warehouse.v2_loads import v2_effects, v2_load, v2_warehouse

    pairs, baselines, effects = synthetic(seed=seed)
    layout = Layout.of(wh) if Layout.of(wh).exists() else v2_warehouse(wh)
    old_baselines = pa.Table.from_pylist(baselines).select(OLD_BASELINE_COLUMNS).cast(
        pa.schema([(c, pa.string() if c == "pair_id" else pa.float32()) for c in OLD_BASELINE_COLUMNS]))
    v2_load(layout, run_id, pairs.drop_columns(["answer_policy"]), old_baselines,
            v2_effects(effects, OLD_EFFECT_COLUMNS), recorded=None)


def test_an_old_shaped_load_is_summarised_on_logit_diff_and_p(tmp_path):
    """The same rows loaded in today's shape and in the shape before every metric had its own columns: the old load has
    logit difference and p only, and on those it is summarised exactly as the new one."""
    wh = tmp_path / "w.duckdb"
    _old_shaped_load(wh, "run-old")
    load(tmp_path, wh, run_id="run-new")  # migrates the warehouse first
    assert count(wh, "effects", "run-old") == count(wh, "effects", "run-new") == 90
    assert query(wh, "SELECT DISTINCT metric FROM effect_summary WHERE run_id = 'run-old' ORDER BY 1")[1] == [
        ("logit_diff",), ("p",)]
    for view in ("effect_summary", "relation_summary", "effect_summary_facts"):
        summaries = {}
        for run in ("run-old", "run-new"):
            cols, rows = query(wh, f"SELECT * EXCLUDE (run_id) FROM {view} WHERE run_id = ? "
                                   "AND metric IN ('logit_diff', 'p') ORDER BY ALL", [run])
            summaries[run] = rows
        old, new = summaries["run-old"], summaries["run-new"]
        assert len(old) == len(new) == 2 * 12 * (2 if view == "relation_summary" else 1), view
        for o, n in zip(old, new):  # 3 layers x 4 roles x 2 metrics; equal up to the order of float sums
            assert list(o) == [pytest.approx(v, rel=1e-12) if isinstance(v, float) else v for v in n], view
    assert query(wh, "SELECT count(*), count(answer_policy) FROM pairs WHERE run_id = 'run-old'")[1] == [(7, 0)]


def test_named_queries_take_a_metric_and_fall_back_without_logprob_diff(tmp_path):
    from patchgrid.warehouse.queries import stream_by_layer, strongest_effects

    wh = tmp_path / "w.duckdb"
    _old_shaped_load(wh, "run-old")  # written before answers were scored: logit_diff and p only
    load(tmp_path, wh, run_id="one-token")
    load(tmp_path, wh, run_id="multi-token", multi_token=True)
    for run, default in (("one-token", "logprob_diff"), ("multi-token", "logprob_diff"), ("run-old", "logit_diff")):
        cols, rows = strongest_effects(wh, run, top=5)
        assert len(rows) == 5 and {r[cols.index("metric")] for r in rows} == {default}, run
        recoveries = [r[cols.index("mean_recovery")] for r in rows]
        assert recoveries == sorted(recoveries, reverse=True)
        cols, rows = stream_by_layer(wh, run, every=2)
        assert {r[cols.index("metric")] for r in rows} == {default} and len(rows) == 4  # layers 0, 2 x 2 roles
    cols, rows = strongest_effects(wh, "one-token", top=3, metric="kl")
    assert {r[cols.index("metric")] for r in rows} == {"kl"}
    # rank has no recovery: its strongest cells are those that bring the clean answer's rank down most
    cols, rows = strongest_effects(wh, "one-token", top=15, metric="rank")
    effects = [r[cols.index("mean_effect")] for r in rows]
    assert effects == sorted(effects) and all(r[cols.index("mean_recovery")] is None for r in rows)
    assert strongest_effects(wh, "multi-token", metric="logit_diff")[1] == []
    from patchgrid.metrics import METRICS
    from patchgrid.warehouse.queries import every_metric

    cols, rows = every_metric(wh, "one-token", (0, 2))
    by_cell = {}
    for r in rows:
        by_cell.setdefault((r[cols.index("layer")], r[cols.index("position_role")]), []).append(r[cols.index("metric")])
    assert set(by_cell) == {(0, "subject_last"), (2, "subject_last"), (0, "last"), (2, "last")}
    assert all(ms == list(METRICS) for ms in by_cell.values())  # every metric, in the registry's order
    with pytest.raises(ValueError, match="metric 'logits' is not one of"):
        stream_by_layer(wh, "one-token", metric="logits")
