"""A damaged activation cache heals itself: checksums written with it find a truncated or
bit-flipped file; it is discarded and rebuilt, and the study completes with the same effects."""
from __future__ import annotations

import shutil
import subprocess

from tests.support.engines import needs_vllm
from tests.support.processes import env_for, study_args, tables

pytestmark = needs_vllm
# the hf backend: a cache's checks and rebuild are the same on every backend, and hf starts in a second
EXTRA = ("--limit", "2", "--sweeps", "resid,mlp_out", "--shard-size", "2", "--backend", "hf")


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_damaged_cache_is_rebuilt_and_the_study_completes(tmp_path):
    env, work = env_for(tmp_path), tmp_path / "work"
    ref = subprocess.run(study_args(tmp_path, tmp_path / "ref.duckdb", work, *EXTRA), env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    for damage in (truncate, flip_a_bit):
        (clean,) = work.glob("cache/*/clean.arrow")
        damage(clean)
        shutil.rmtree(work / "runs")  # the shards must be swept again, from the cache
        wh = tmp_path / f"{damage.__name__}.duckdb"
        res = subprocess.run(study_args(tmp_path, wh, work, *EXTRA), env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        (rebuilt,) = work.glob("cache/*/clean.arrow")
        assert rebuilt.stat().st_size > 0 and "Traceback" not in res.stderr
        a, b = tables(wh), tables(tmp_path / "ref.duckdb")
        for table in ("effects", "baselines", "pairs"):
            assert a[table] == b[table], f"{damage.__name__}: {table} differs from the untouched cache's"
        assert len(a["effects"]) > 100
