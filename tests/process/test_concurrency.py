"""Two studies started at once load into one warehouse while a dashboard holds it open: both finish
with all their rows, and the dashboard's queries succeed throughout and never see half a run."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from patchgrid.warehouse.loader import ensure, query
from tests.support.engines import needs_vllm
from tests.support.paths import REPO
from tests.support.processes import env_for, start, study_args

pytestmark = needs_vllm

# A dashboard: one read-only DuckDB connection to the warehouse file, held for the whole test and
# queried over and over (as Grafana's DuckDB plugin and Evidence do), beside patchgrid's own queries.
DASHBOARD = textwrap.dedent("""
    import json, sys, time
    import duckdb
    sys.path.insert(0, {repo!r})
    from patchgrid.warehouse.loader import query
    wh, log, stop = sys.argv[1], open(sys.argv[2], "a"), sys.argv[3]
    con = duckdb.connect(wh, read_only=True)
    import os
    while not os.path.exists(stop):
        for source in ("dashboard", "patchgrid"):
            sql = ("SELECT e.run_id, count(DISTINCT e.pair_id), "
                   "(SELECT count(*) FROM pairs p WHERE p.run_id = e.run_id), "
                   "(SELECT count(*) FROM baselines b WHERE b.run_id = e.run_id) FROM effects e GROUP BY e.run_id")
            try:
                rows = con.execute(sql).fetchall() if source == "dashboard" else query(wh, sql)[1]
                log.write(json.dumps({{"source": source, "rows": rows}}) + "\\n")
            except Exception as exc:
                log.write(json.dumps({{"source": source, "error": str(exc)}}) + "\\n")
            log.flush()
        time.sleep(0.5)  # a dashboard's refresh; each round's two queries take ~0.1 s of a core
    con.close()
""")


def test_two_studies_load_while_a_dashboard_reads(tmp_path):

    wh = tmp_path / "shared.duckdb"
    ensure(wh)  # the dashboard opens the warehouse before any study has run
    script = tmp_path / "dashboard.py"
    script.write_text(DASHBOARD.format(repo=str(REPO)))
    log, stop = tmp_path / "dashboard.jsonl", tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, str(script), str(wh), str(log), str(stop)])
    env = env_for(tmp_path, temporary_server=True)  # one PREFECT_HOME: two temporary servers migrate it at once
    try:
        # the hf backend: the warehouse's loads are the point, not the engine (hf starts in a second)
        procs = [start(study_args(tmp_path, wh, tmp_path / f"work{i}", "--limit", str(2 + i), "--sweeps", "resid",
                                  "--shard-size", "1", "--backend", "hf"), env, tmp_path) for i in range(2)]
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        stop.write_text("")
        reader.wait(timeout=60)
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        # neither a DuckDB lock conflict nor Prefect's SQLite lock reaches the user
        assert "Conflicting lock" not in err and "database is locked" not in err, err[-2000:]
    run_ids = [out.strip().splitlines()[-1] for out, _ in outs]
    assert len(set(run_ids)) == 2
    full = {run_ids[0]: [2, 1157, 2], run_ids[1]: [3, 1157, 3]}  # pairs with effects, pair records, baselines

    seen = [json.loads(line) for line in log.read_text().splitlines()]
    errors = [s for s in seen if "error" in s]
    assert not errors, errors[:3]
    for source in ("dashboard", "patchgrid"):
        mine = [s["rows"] for s in seen if s["source"] == source]
        assert len(mine) > 20
        for rows in mine:  # every run a reader saw, it saw whole
            for run_id, *counts in rows:
                assert counts == full[run_id], (source, run_id, counts)
        assert sorted(r[0] for r in mine[-1]) == sorted(run_ids)  # and the held connection saw both land

    per_run = dict(query(wh, "SELECT run_id, count(DISTINCT pair_id) FROM effects GROUP BY run_id")[1])
    assert per_run == {run_ids[0]: 2, run_ids[1]: 3}
    assert query(wh, "SELECT count(*) FROM runs WHERE status = 'completed'")[1] == [(2,)]
