"""Kill -9 during the sweeps, rerun the same study: it resumes, and the warehouse ends identical."""
from __future__ import annotations

import subprocess
import time

from tests.support.engines import needs_vllm
from tests.support.processes import cli_here, env_for, kill9, start, study_args, study_cli_args, tables, wait_for

pytestmark = needs_vllm
# the hf backend: what resumes is the cache and the shards, the same on every backend (hf starts in a second)
EXTRA = ("--limit", "6", "--shard-size", "1", "--sweeps", "resid,heads,trace", "--trace-samples", "3",
         "--backend", "hf")


def test_kill9_mid_sweep_then_resume_matches_an_uninterrupted_run(prefect_api, tmp_path):
    env = env_for(tmp_path)
    # the reference: the same study, never interrupted, in its own work folder and warehouse (run in this
    # process: only the study that is killed and resumed needs a process of its own)
    ref = cli_here(*study_cli_args(tmp_path / "ref.duckdb", tmp_path / "ref-work", *EXTRA), cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]

    wh, work = tmp_path / "w.duckdb", tmp_path / "work"
    args = study_args(tmp_path, wh, work, *EXTRA)
    proc = start(args, env, tmp_path)
    shards = lambda: sorted(work.glob("runs/*/effects/shard-*.parquet"))  # noqa: E731
    wait_for(lambda: len(shards()) >= 2, 600, proc, "two finished shards")
    kill9(proc)
    done = {p: p.stat().st_mtime_ns for p in shards()}
    assert 2 <= len(done) < 6, "the kill came too late to interrupt the sweeps"
    caches = sorted(work.glob("cache/*/manifest.json"))
    assert len(caches) == 2  # the pairs' and the traced facts'
    # the cache's data files (its manifest may gain the files' stats when they are first checked)
    cached_files = lambda: {f: f.stat().st_mtime_ns for c in caches for f in c.parent.iterdir()  # noqa: E731
                            if f.name != "manifest.json"}
    cache_mtimes = cached_files()

    t0 = time.monotonic()
    rerun = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    resume_s = time.monotonic() - t0
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.stdout.strip().splitlines()[-1] == ref.stdout.strip().splitlines()[-1]  # the same run id
    # no clean forward again: the cache folders are the ones written before the kill
    assert sorted(work.glob("cache/*/manifest.json")) == caches
    assert cached_files() == cache_mtimes
    # finished shards were not rerun
    for p, mtime in done.items():
        assert p.stat().st_mtime_ns == mtime, f"{p.name} was computed again"
    assert len(shards()) == 6
    a, b = tables(wh), tables(tmp_path / "ref.duckdb")
    for table in a:
        assert a[table] == b[table], f"{table} differs from the uninterrupted run"
    assert len(a["effects"]) > 1000
    print(f"resume took {resume_s:.1f} s")
