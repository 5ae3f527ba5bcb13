"""`damage`: a cache data set checked against the sizes and sha256 sums written with it."""
from __future__ import annotations

import json
from pathlib import Path

from ..models import sha256_file


def damage(folder: str | Path) -> str | None:
    """What is wrong with a cache data set, checked against the sizes and sha256 sums written with
    it; None when it is sound."""
    folder = Path(folder)
    try:
        files = json.loads((folder / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable manifest"
    for name, (size, digest) in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
        if sha256_file(path) != digest:
            return f"{name} does not match its sha256"
    return None
