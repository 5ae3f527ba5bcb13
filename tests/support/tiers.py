"""Every test's tier is the folder it is in (tests/README.md says what each proves and costs):

    unit     tests/unit/     no engine, no Prefect, no process of its own: `make test-fast`
    engine   tests/engine/   starts or uses an engine in this process (the `engines` fixture), or is as heavy
                             (a model's forward and backward in process, Chromium, a whole report rendered)
    flow     tests/flow/     runs Prefect flows in this process against the session's Prefect API
    process  tests/process/  runs patchgrid as processes of its own: the command line, `serve`, workers, a
                             wheel installed into a fresh venv, processes killed

Each is marked with its tier at collection (`pytest -m engine`), so that a tier runs alone; a test
file never names its tier. `slow` (the pretrained smollm2-135m model) is independent of the tier.
"""
from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "engine", "flow", "process")
TESTS = Path(__file__).resolve().parents[1]


def tier_of(item) -> str:
    """The tier of `item`: the folder under tests/ it is in."""
    where = Path(item.path).resolve().relative_to(TESTS)
    if where.parts[0] not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test lives in the folder of its tier, one of "
                                f"{', '.join(f'tests/{t}/' for t in TIERS)}")
    named = [t for t in TIERS if item.get_closest_marker(t) is not None]
    if named:
        raise pytest.UsageError(f"{item.nodeid} is marked {named[0]}: a test's tier is its folder, never a marker")
    return where.parts[0]


def mark_tiers(items) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
