"""The documents the docs tests read: README.md, CONTRIBUTING.md and every page of docs/."""
from __future__ import annotations

from pathlib import Path

from tests.support.paths import REPO

ROOT = REPO
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()
