"""Weights fingerprinted once per file version, and activation caches checked by their files' stats:
a file whose stat (size, mtime, ctime, inode) matches its record is not read again; any other is."""
from __future__ import annotations

import contextlib
import json
import subprocess

import pytest

from patchgrid.model.models import WEIGHTS_RECORD, weights_hash
from tests.unit.pipeline.test_fingerprint_records import hashed_in_full, weights_folder


@contextlib.contextmanager
def read_only(folder):
    """`folder` made unwritable: by its mode, or, for root, whom modes do not stop, immutable."""
    folder.chmod(0o555)
    immutable = False
    try:
        probe = folder / ".probe"
        try:
            probe.write_text("")
        except OSError:
            pass
        else:
            probe.unlink()
            immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
            if not immutable:
                pytest.skip("cannot make a folder read-only here (root, and no chattr +i)")
        yield folder
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        folder.chmod(0o755)


def test_a_read_only_folder_records_under_the_cache_root(tmp_path, reads):
    folder = weights_folder(tmp_path)
    with read_only(folder):
        first = weights_hash(folder)
        assert first == hashed_in_full(folder) and not (folder / WEIGHTS_RECORD).exists()
        (outside,) = (tmp_path / "home" / "weight-records").glob("*.json")
        assert json.loads(outside.read_text())["folder"] == str(folder.resolve())
        reads.clear()
        assert weights_hash(folder) == first and reads == []

