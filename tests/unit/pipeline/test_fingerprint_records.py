"""Weights fingerprinted once per file version, and activation caches checked by their files' stats:
a file whose stat (size, mtime, ctime, inode) matches its record is not read again; any other is."""
from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from patchgrid.cache import damage
from patchgrid.model import models
from patchgrid.model.models import WEIGHTS_RECORD, weights_hash

LONG_AGO = time.time() - 3600


@pytest.fixture
def reads(monkeypatch):
    """The files sha256_file reads, in order: a wrapper of our own around the real one."""
    seen = []
    real = models.sha256_file

    def counting(path, *args, **kwargs):
        seen.append(os.path.basename(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(models, "sha256_file", counting)
    return seen


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHGRID_HOME", str(tmp_path / "home"))


def settle(*paths):
    """Set mtime an hour back, as for any file not written in the last seconds."""
    for p in paths:
        os.utime(p, (LONG_AGO, LONG_AGO))


def weights_folder(tmp_path, sizes=(3000, 5000)):
    folder = tmp_path / "model"
    folder.mkdir()
    for i, size in enumerate(sizes):
        (folder / f"model-{i:05d}-of-{len(sizes):05d}.safetensors").write_bytes(os.urandom(size))
    (folder / "config.json").write_text("{}")
    settle(*folder.glob("*.safetensors"))
    return folder


def hashed_in_full(folder):
    """What weights_hash returned before records: sha256 over each file's name and sha256, in name order."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(hashlib.sha256(f.read_bytes()).hexdigest().encode())
    return h.hexdigest()


def flip_in_place(path, at=None):
    """One byte changed in place: the same inode and size."""
    with open(path, "r+b") as f:
        f.seek(at if at is not None else path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_record_is_written_and_a_second_call_reads_no_weight_file(tmp_path, reads):
    folder = weights_folder(tmp_path)
    first = weights_hash(folder)
    assert first == hashed_in_full(folder)
    assert len(reads) == 2
    record = json.loads((folder / WEIGHTS_RECORD).read_text())
    assert sorted(record["files"]) == sorted(f.name for f in folder.glob("*.safetensors"))
    reads.clear()
    assert weights_hash(folder) == first and reads == []


def test_a_changed_file_is_hashed_again_and_only_it(tmp_path, reads):
    folder = weights_folder(tmp_path)
    first = weights_hash(folder)
    changed = sorted(folder.glob("*.safetensors"))[1]
    flip_in_place(changed)
    settle(changed)  # even with its mtime set back, its ctime tells
    reads.clear()
    second = weights_hash(folder)
    assert reads == [changed.name]
    assert second != first and second == hashed_in_full(folder)
    reads.clear()
    assert weights_hash(folder) == second and reads == []


def test_a_touched_file_is_hashed_again_to_the_same_hash(tmp_path, reads):
    folder = weights_folder(tmp_path)
    first = weights_hash(folder)
    touched = sorted(folder.glob("*.safetensors"))[0]
    os.utime(touched, (LONG_AGO - 60, LONG_AGO - 60))
    reads.clear()
    assert weights_hash(folder) == first and reads == [touched.name]


def test_a_file_replaced_by_one_of_the_same_size_and_mtime_is_hashed_again(tmp_path, reads):
    """A copy that keeps the mtime (cp -p, rsync -t) then renamed over the file: a new inode."""
    folder = weights_folder(tmp_path)
    first = weights_hash(folder)
    target = sorted(folder.glob("*.safetensors"))[0]
    st = target.stat()
    other = tmp_path / "other"
    other.write_bytes(os.urandom(st.st_size))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, target)
    reads.clear()
    assert weights_hash(folder) != first and reads == [target.name]
    assert weights_hash(folder) == hashed_in_full(folder)


def test_a_file_modified_just_now_is_not_recorded(tmp_path, reads):
    """Its timestamp tick may not be over: a change within it would not show in its stat."""
    folder = weights_folder(tmp_path)
    fresh = sorted(folder.glob("*.safetensors"))[0]
    fresh.write_bytes(os.urandom(3000))
    weights_hash(folder)
    assert fresh.name not in json.loads((folder / WEIGHTS_RECORD).read_text())["files"]
    reads.clear()
    assert weights_hash(folder) == hashed_in_full(folder) and reads == [fresh.name]


def test_a_damaged_or_unreadable_record_is_hashed_in_full(tmp_path, reads):
    folder = weights_folder(tmp_path)
    first = weights_hash(folder)
    (folder / WEIGHTS_RECORD).write_text("{not json")
    reads.clear()
    assert weights_hash(folder) == first and len(reads) == 2
    record = json.loads((folder / WEIGHTS_RECORD).read_text())
    name = sorted(record["files"])[0]
    record["files"][name]["sha256"] = "0" * 64  # a record that lies is believed: only the stat is checked
    (folder / WEIGHTS_RECORD).write_text(json.dumps(record))
    assert weights_hash(folder) != first


def cache_folder(tmp_path, with_stats=True):
    folder = tmp_path / "cache"
    folder.mkdir()
    for name, size in (("baselines.arrow", 700), ("clean.arrow", 9000), ("corrupt.arrow", 9000)):
        (folder / name).write_bytes(os.urandom(size))
    settle(*folder.iterdir())
    files = {f.name: [f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest()] for f in sorted(folder.iterdir())}
    manifest = {"version": 4, "files": files}
    if with_stats:
        manifest["stats"] = {f.name: models.file_stat(f) for f in folder.iterdir()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_a_sound_cache_is_checked_without_reading_its_files(tmp_path, reads):
    folder = cache_folder(tmp_path)
    assert damage(folder) is None and reads == []


@pytest.mark.parametrize("how", ["flip", "flip, mtime restored", "truncate", "replaced, mtime kept"])
def test_damage_after_the_stat_changed_is_found(tmp_path, reads, how):
    folder = cache_folder(tmp_path)
    path = folder / "clean.arrow"
    st = path.stat()
    if how.startswith("flip"):
        flip_in_place(path)
        if how == "flip, mtime restored":
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif how == "truncate":
        os.truncate(path, st.st_size // 2)
    else:
        data = bytearray(path.read_bytes())
        data[10] ^= 1
        (tmp_path / "copy").write_bytes(bytes(data))
        os.utime(tmp_path / "copy", ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp_path / "copy", path)
    problem = damage(folder)
    assert problem is not None and "clean.arrow" in problem
    assert reads in ([], ["clean.arrow"])  # by its size, or by its sha256: nothing else is read


def test_an_old_manifest_without_stats_is_hashed_in_full_then_recorded(tmp_path, reads):
    folder = cache_folder(tmp_path, with_stats=False)
    assert damage(folder) is None
    assert sorted(reads) == ["baselines.arrow", "clean.arrow", "corrupt.arrow"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["stats"] == {f: models.file_stat(folder / f) for f in manifest["files"]}
    reads.clear()
    assert damage(folder) is None and reads == []


def test_an_old_manifest_finds_a_flip_that_kept_the_stat_it_never_had(tmp_path, reads):
    folder = cache_folder(tmp_path, with_stats=False)
    flip_in_place(folder / "corrupt.arrow")
    settle(folder / "corrupt.arrow")
    assert damage(folder) == "corrupt.arrow does not match its sha256"
    assert "stats" not in json.loads((folder / "manifest.json").read_text())


def test_a_cache_file_written_just_now_has_no_stat_recorded(tmp_path, reads):
    folder = cache_folder(tmp_path, with_stats=False)
    os.utime(folder / "clean.arrow")  # now
    assert damage(folder) is None
    assert "clean.arrow" not in json.loads((folder / "manifest.json").read_text())["stats"]
    reads.clear()
    assert damage(folder) is None and reads == ["clean.arrow"]

