"""Fingerprints of inputs (files by content, parameters by value) for run ids and task caching."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

_FILE_HASHES: dict[tuple, str] = {}


def file_sha256(path: str | Path) -> str:
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILE_HASHES:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        _FILE_HASHES[key] = h.hexdigest()
    return _FILE_HASHES[key]


def fingerprint(*parts) -> str:
    """sha256 of JSON-able parts; a part that names an existing file counts by its content."""

    def norm(x):
        if isinstance(x, (list, tuple)):
            return [norm(v) for v in x]
        if isinstance(x, dict):
            return {str(k): norm(v) for k, v in sorted(x.items())}
        if isinstance(x, Path) or (isinstance(x, str) and len(x) < 4096 and _is_file(x)):
            return {"file_sha256": file_sha256(x)}
        return x

    return hashlib.sha256(json.dumps(norm(list(parts)), sort_keys=True, default=str).encode()).hexdigest()


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except OSError:
        return False
