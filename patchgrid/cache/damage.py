"""`damage`: a cache data set checked against the sizes and sha256 sums written with it. A file
whose stat (size, times, inode) is the one recorded with its sha256 is not read again; any other,
and every file of a manifest from before stats were recorded, is hashed in full."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..model.models import file_stat, settled_sha256


def damage(folder: str | Path) -> str | None:
    """What is wrong with a cache data set, checked against the sizes and sha256 sums written with
    it; None when it is sound. Files hashed here whose stat can vouch for them from now on have it
    recorded in the manifest, so that the next check need not read them."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        files = manifest["files"]
        stats = manifest.get("stats") or {}
        entries = [(name, int(size), str(digest)) for name, (size, digest) in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "no readable manifest"
    fresh = {}
    for name, size, digest in entries:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        stat = file_stat(path)
        if stat[0] != size:
            return f"{name} has {stat[0]} bytes, {size} were written"
        if stats.get(name) == stat:
            continue  # the very file its sha256 was taken of
        now, settled = settled_sha256(path)
        if now != digest:
            return f"{name} does not match its sha256"
        if settled:
            fresh[name] = settled
    if fresh:
        _record_stats(folder, {**manifest, "stats": {**stats, **fresh}})
    return None


def _record_stats(folder: Path, manifest: dict) -> None:
    """Rewrite the manifest with the stats of files just found sound, atomically; a cache folder
    that cannot be written keeps its manifest (its next check hashes those files again)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".manifest.", dir=folder)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(manifest))
        os.chmod(tmp, os.stat(folder / "manifest.json").st_mode & 0o777)  # mkstemp's is 0600
        os.replace(tmp, folder / "manifest.json")
    except OSError:
        Path(tmp).unlink(missing_ok=True)
