"""How `make test` shares the suite between two worker processes (pytest-xdist: `-n 2 --dist loadgroup`).

Most of a test's time on these machines is one core's: Python in a tiny model's forward, a process
importing torch and vLLM, a Prefect server answering, a schedule waited for. Two workers keep both
cores busy, each with the session fixtures of its own (its engine pool, its Prefect server):

- the tests that take the session's engines (the `engines` fixture, directly or through another
  fixture) run as one group, in collection order, on one worker, so that each engine starts once, as
  in a run with no workers;
- every other test file is a group of its own (its module fixtures built once), handed to whichever
  worker is free.

Without `-n` (a tier or a file run alone) the groups change nothing. The engines a worker started
reach the controller's summary through xdist's worker output (`engine starts`, tests/conftest.py).
"""
from __future__ import annotations

import json

import pytest

SHARED_ENGINES = "engines"  # the xdist group of the tests that take the `engines` fixture


def group_for_workers(items) -> None:
    """Give every test its xdist group: the shared engines', or its file's."""
    for item in items:
        takes_engines = "engines" in getattr(item, "fixturenames", ())
        group = SHARED_ENGINES if takes_engines else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def check_grouped(config, ids) -> None:
    """On the controller of `--dist loadgroup`, a worker's collected test ids: each carries its group
    (`@group`), or xdist distributes the tests one by one, as it silently does on pytest 9.2
    (pytest-dev/pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if "@" not in nodeid.rsplit("]", 1)[-1]]
    if lost:
        pytest.exit(f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}): its --dist loadgroup does not "
                    "work with this pytest (pyproject.toml's test extra pins one it works with)", returncode=4)


def send_engine_starts(config, starts) -> None:
    """On a worker: its engine starts, for the controller's summary."""
    if hasattr(config, "workeroutput"):
        config.workeroutput["engine_starts"] = json.dumps(starts)


def received_engine_starts(node) -> list[tuple[str, str, float, str]]:
    """On the controller: the engine starts a finished worker sent."""
    return [tuple(s) for s in json.loads(getattr(node, "workeroutput", {}).get("engine_starts", "[]"))]
