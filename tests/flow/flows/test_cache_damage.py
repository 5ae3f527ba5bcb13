"""A damaged activation cache heals itself: checksums written with it find a truncated or
bit-flipped file; it is discarded and rebuilt, and the study completes with the same effects.
`patchgrid study` runs in this process, against the session's Prefect API (nothing here needs a
process of its own: the damage is done between studies)."""
from __future__ import annotations

import shutil

from tests.support.processes import cli_here, study_cli_args, tables

# the hf backend: a cache's checks and rebuild are the same on every backend, and hf starts in a second
EXTRA = ("--limit", "2", "--sweeps", "resid,mlp_out", "--shard-size", "2", "--backend", "hf")


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _study(tmp_path, warehouse, work):
    return cli_here(*study_cli_args(warehouse, work, *EXTRA), cwd=tmp_path)


def test_a_damaged_cache_is_rebuilt_and_the_study_completes(prefect_api, tmp_path):
    work = tmp_path / "work"
    ref = _study(tmp_path, tmp_path / "ref.duckdb", work)
    assert ref.returncode == 0, ref.stderr[-3000:]
    for damage in (truncate, flip_a_bit):
        (clean,) = work.glob("cache/*/clean.arrow")
        damage(clean)
        shutil.rmtree(work / "runs")  # the shards must be swept again, from the cache
        wh = tmp_path / f"{damage.__name__}.duckdb"
        res = _study(tmp_path, wh, work)
        assert res.returncode == 0, res.stderr[-3000:]
        (rebuilt,) = work.glob("cache/*/clean.arrow")
        assert rebuilt.stat().st_size > 0 and "Traceback" not in res.stderr
        a, b = tables(wh), tables(tmp_path / "ref.duckdb")
        for table in ("effects", "baselines", "pairs"):
            assert a[table] == b[table], f"{damage.__name__}: {table} differs from the untouched cache's"
        assert len(a["effects"]) > 100
