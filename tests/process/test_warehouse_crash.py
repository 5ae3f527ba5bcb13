"""Kill -9 during a warehouse load: the warehouse opens, holds no partial run, and a rerun completes it."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from patchgrid.warehouse.loader import connect, query
from tests.support.paths import REPO
from tests.support.processes import kill9, wait_for

LOADER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    import pyarrow.parquet as pq
    from benchmarks.warehouse_scale import pairs_for, synthetic_run
    from patchgrid.warehouse.loader import load_run, start_run
    wh, effects, marker = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    if not effects.exists():
        pq.write_table(synthetic_run(int(sys.argv[4]), 0), effects)
    table = pq.read_table(effects)
    start_run(wh, {{"run_id": "run-big", "model": "synthetic"}})
    marker.write_text("loading")
    load_run(wh, "run-big", pairs_for(table), [], [effects])
    marker.write_text("done")
""")


def _loader(tmp_path, rows):

    repo = str(REPO)
    script = tmp_path / "load.py"
    script.write_text(LOADER.format(repo=repo))
    return [sys.executable, str(script), str(tmp_path / "w.duckdb"), str(tmp_path / "effects.parquet"),
            str(tmp_path / "marker"), str(rows)]


def test_kill9_mid_load_leaves_no_partial_run(tmp_path):
    wh = tmp_path / "w.duckdb"
    marker = tmp_path / "marker"
    proc = subprocess.Popen(_loader(tmp_path, 3_000_000), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for(lambda: marker.exists() and marker.read_text() == "loading", 300, proc, "the load to start")
    kill9(proc)
    assert marker.read_text() == "loading", "the load finished before the kill"

    connect(wh).close()  # opens: the unfinished load was never published
    assert query(wh, "SELECT count(*) FROM effects")[1][0][0] == 0
    assert query(wh, "SELECT count(*) FROM pairs")[1][0][0] == 0
    assert query(wh, "SELECT status FROM runs WHERE run_id = 'run-big'")[1] == [("running",)]

    done = subprocess.run(_loader(tmp_path, 3_000_000), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert query(wh, "SELECT count(*) FROM effects")[1][0][0] == 3_000_000
    assert query(wh, "SELECT status FROM runs WHERE run_id = 'run-big'")[1] == [("completed",)]
