"""Where a warehouse's files live, and how a file or folder appears in it all at once.

A warehouse is a folder of Parquet files plus a small DuckDB file of view definitions:

    warehouse.duckdb                           views only: what dashboards open, read-only
    warehouse.data/patchgrid.json              {"schema": 3}
    warehouse.data/runs/run_id=<id>/status/<stamp>.parquet          one rows.RUN row per state
    warehouse.data/runs/run_id=<id>/load=<stamp>/pairs.parquet      a run's rows, one folder per load
                                               .../baselines.parquet
                                               .../effects/row_shape=<shape>/part-<k>.parquet  by row shape
                                               .../sweep_kinds.parquet   the shape of each sweep's rows
                                                                         (kinds.py)

Schema 2 kept every effect row in one shape (effects/part-<k>.parquet); migrate.py turns it into 3.

Nothing is ever changed in place. A writer builds a file or a load folder under a name no glob
matches and renames it into place (atomic on POSIX file systems and NFS), so a reader sees a
load whole or not at all. Writers never share a file: a stamp (time, host, process) names each
one, so studies on many machines can write into one shared folder at once with no lock. The
latest load of a run is the one published (a rerun replaces its run's rows); superseded loads are
removed once they have been superseded for longer than any reader could still be reading them.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA_VERSION = 3
# A superseded load stays on disk this long, so that a reader that listed it still reads it.
SUPERSEDED_GRACE_S = 600.0
TMP_PREFIX = ".tmp-"  # never matched by a reader's glob
# The files that make each glob match something in a warehouse with no runs yet (DuckDB refuses
# a read_parquet glob that matches nothing). They hold no rows.
EMPTY_RUN = "_"


def stamp() -> str:
    """Sorts by time; unique across hosts and processes."""
    host = socket.gethostname().replace("/", "_").replace("=", "_") or "host"
    return f"{time.time_ns():020d}-{host}-{os.getpid()}"


def stamp_ns(name: str) -> int:
    return int(name.split("-", 1)[0])


@dataclass(frozen=True)
class Layout:
    catalog: Path  # the DuckDB file of views

    @classmethod
    def of(cls, path: str | Path) -> Layout:
        return cls(Path(path))

    @property
    def data(self) -> Path:
        return self.catalog.with_name(self.catalog.stem + ".data")

    @property
    def version_file(self) -> Path:
        return self.data / "patchgrid.json"

    @property
    def runs(self) -> Path:
        return self.data / "runs"

    def run_dir(self, run_id: str) -> Path:
        return self.runs / f"run_id={run_id}"

    def status_dir(self, run_id: str) -> Path:
        return self.run_dir(run_id) / "status"

    def loads(self, run_id: str) -> list[Path]:
        """The run's published loads, oldest first."""
        folder = self.run_dir(run_id)
        return sorted((p for p in folder.glob("load=*") if p.is_dir()), key=lambda p: p.name) if folder.is_dir() else []

    def glob(self, what: str) -> str:
        """The absolute glob a view reads (`what`: status, pairs, baselines, effects, sweep_kinds)."""
        root = self.runs.resolve()
        return str(root / {"status": "*/status/*.parquet", "pairs": "*/load=*/pairs.parquet",
                           "baselines": "*/load=*/baselines.parquet",
                           "effects": "*/load=*/effects/row_shape=*/*.parquet",
                           "sweep_kinds": "*/load=*/sweep_kinds.parquet"}[what])

    def exists(self) -> bool:
        return self.version_file.is_file()

    def version(self) -> int:
        try:
            return int(json.loads(self.version_file.read_text())["schema"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.version_file} is unreadable ({exc})") from None


def publish_file(write, final: Path) -> Path:
    """`write(tmp_path)` then rename into `final`'s place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}-{stamp()}")  # ends in no reader's suffix
    try:
        write(tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def publish_dir(fill, parent: Path, name: str) -> Path:
    """`fill(tmp_folder)` then rename the whole folder to parent/name (which must not exist)."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f"{TMP_PREFIX}{name}-{stamp()}"
    tmp.mkdir()
    try:
        fill(tmp)
        _fsync_tree(tmp)
        os.rename(tmp, parent / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return parent / name


def _fsync_tree(folder: Path) -> None:
    """Data on disk before the rename makes it visible: a crash never publishes a torn file."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def remove_superseded(layout: Layout, run_id: str, now_ns: int | None = None) -> int:
    """Delete the run's loads superseded more than SUPERSEDED_GRACE_S ago, and load folders a
    crashed writer left half-built that long ago. Returns how many were removed."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    grace_ns = int(SUPERSEDED_GRACE_S * 1e9)
    loads = layout.loads(run_id)
    removed = 0
    for older, newer in zip(loads, loads[1:]):
        if now_ns - stamp_ns(newer.name.removeprefix("load=")) > grace_ns:
            shutil.rmtree(older, ignore_errors=True)
            removed += 1
    folder = layout.run_dir(run_id)
    leftovers = [*folder.glob(f"{TMP_PREFIX}*"), *folder.glob(f"status/{TMP_PREFIX}*")] if folder.is_dir() else []
    for tmp in leftovers:
        try:
            old = now_ns - tmp.stat().st_mtime_ns > grace_ns
        except OSError:
            continue
        if old:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            removed += 1
    return removed
