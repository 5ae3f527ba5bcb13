"""Where the tests find the repository's own files (data/, docs/, prefect.yaml, pyproject.toml)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
