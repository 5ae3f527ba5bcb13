"""Two studies started at once against one warehouse both finish with all their rows, no lock errors."""
from __future__ import annotations

from tests.conftest import needs_vllm

from .helpers import env_for, start, study_args

pytestmark = needs_vllm


def test_two_studies_at_once_share_a_warehouse(tmp_path):
    wh = tmp_path / "shared.duckdb"
    env = env_for(tmp_path)
    procs = [start(study_args(tmp_path, wh, tmp_path / f"work{i}", "--limit", str(2 + i), "--sweeps", "resid",
                              "--shard-size", "1"), env, tmp_path) for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        # neither DuckDB's lock conflict nor Prefect's SQLite lock reaches the user
        assert "Conflicting lock" not in err and "database is locked" not in err, err[-2000:]
    run_ids = [out.strip().splitlines()[-1] for out, _ in outs]
    assert len(set(run_ids)) == 2

    import duckdb

    con = duckdb.connect(str(wh), read_only=True)
    try:
        per_run = dict(con.execute("SELECT run_id, count(DISTINCT pair_id) FROM effects GROUP BY run_id").fetchall())
        assert per_run == {run_ids[0]: 2, run_ids[1]: 3}
        assert con.execute("SELECT count(*) FROM runs WHERE status = 'completed'").fetchone()[0] == 2
        for run_id in run_ids:
            n_pairs = con.execute("SELECT count(*) FROM pairs WHERE run_id = ?", [run_id]).fetchone()[0]
            assert n_pairs == 1157
    finally:
        con.close()
