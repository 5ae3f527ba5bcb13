"""Where the suite's CPU goes: an opt-in pytest plugin that writes each test's CPU seconds to a CSV.

    .venv/bin/python -m pytest -p tests.support.cpu_time -n 2 --dist loadgroup tests
    # then: sort -t, -k5 -gr cpu-time*.csv | head

Per test (setup, call and teardown together): its wall seconds, the CPU seconds of the test's own
process (user and system), and those of the child processes it waited for (`subprocess.run`, a
`Popen` it waited on: a command line's study, `serve`, an engine core it closed). Processes nobody
waited for (a shared Prefect server, a Ray cluster's nodes until they stop) are not counted. The
suite on 2 cores is bound by its CPU seconds, not by how its tests are shared between workers: this
says which tests to make cheaper. One file per process: `cpu-time.csv`, or `cpu-time-gw0.csv` on
xdist worker gw0 (in the directory pytest runs in; `PATCHGRID_CPU_TIME_DIR` sets another).
"""
from __future__ import annotations

import csv
import os
import resource
import time
from pathlib import Path

import pytest

_ROWS: list[tuple[str, float, float, float, float]] = []  # (test, wall, own cpu, children's cpu, both)


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, own, children = time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    own = _cpu(resource.RUSAGE_SELF) - own
    children = _cpu(resource.RUSAGE_CHILDREN) - children
    _ROWS.append((item.nodeid, time.monotonic() - wall, own, children, own + children))


def pytest_sessionfinish(session):
    if not _ROWS:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    folder = Path(os.environ.get("PATCHGRID_CPU_TIME_DIR", session.config.invocation_params.dir))
    path = folder / (f"cpu-time-{worker}.csv" if worker else "cpu-time.csv")
    with open(path, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["test", "wall_s", "own_cpu_s", "children_cpu_s", "cpu_s"])
        writer.writerows((test, f"{w:.2f}", f"{o:.2f}", f"{c:.2f}", f"{t:.2f}") for test, w, o, c, t in _ROWS)
