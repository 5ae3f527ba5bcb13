"""Fingerprints of inputs (files by content, parameters by value) for run ids and task caching."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

_FILE_HASHES: dict[tuple, str] = {}


@dataclasses.dataclass(frozen=True)
class OutputPath:
    """Where something is written. It counts by its path alone: a key taken before the file exists
    (when a first run stores its result) must equal the key taken after (when a rerun looks it up)."""

    path: str


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
    """sha256 of JSON-able parts; a part that names an existing file counts by its content, an
    OutputPath (or a dataclass field marked as an output) by its path."""

    def norm(x):
        if isinstance(x, OutputPath):
            return {"output": os.path.abspath(x.path)}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            # a field marked as an output counts by where it points, not by what is there now
            return {f.name: norm(OutputPath(getattr(x, f.name)) if f.metadata.get("output") else getattr(x, f.name))
                    for f in dataclasses.fields(x)}
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
