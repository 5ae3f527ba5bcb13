"""How `make test` shares the suite between two worker processes (pytest-xdist: `-n 2 --dist loadgroup`).

Most of a test's time on these machines is one core's: Python in a tiny model's forward, a process
importing torch and vLLM, a Prefect server answering, a schedule waited for. Two workers keep both
cores busy, each with the session fixtures of its own (its engine pool):

- the tests that take the session's engines (the `engines` fixture, directly or through another
  fixture) run as one group, in collection order, on one worker, so that each engine starts once, as
  in a run with no workers;
- every other test file is a group of its own (its module fixtures built once), handed to whichever
  worker is free.

Groups are handed out heaviest first (the Ray module, whose cluster's processes run beside the other
worker's, and the shared engines' group, so that the two start at once on different workers; then the
process, flow, engine and unit tiers, `--no-loadscope-reorder` keeping that order), so that the run ends
on small unit files, not on a worker still busy with a study while the other waits. Each worker, and
every process it starts, runs on a core of its own with one thread (`one_core_each`): two processes of
two threads each on two cores lose more to each other (OpenMP threads spinning while the other process
has the core) than either gains from its second thread on these tiny models; what needs two cores (a
tensor-parallel engine's ranks) starts inside `all_cores()`.

Without `-n` (a tier or a file run alone) the groups and the order change nothing. The engines a worker started
reach the controller's summary through xdist's worker output (`engine starts`, tests/conftest.py).
The controller starts the Prefect server the workers share (tests/support/prefect_server.py) before
it starts them, unless it runs the unit tier alone, which needs none.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.prefect_server import SHARED_API, start_server, stop_server
from tests.support.tiers import TESTS

SERVER = pytest.StashKey()  # the controller's shared Prefect server process

SHARED_ENGINES = "engines"  # the xdist group of the tests that take the `engines` fixture
# the order groups are handed out in: the heaviest first
RAY = "tests/flow/flows/test_ray.py"
FIRST = (RAY, SHARED_ENGINES, "tests/process/", "tests/flow/", "tests/engine/", "tests/unit/")
MACHINE_CPUS = frozenset(os.sched_getaffinity(0))  # every core this process may use, before any is chosen


def _group(item) -> str:
    return SHARED_ENGINES if "engines" in getattr(item, "fixturenames", ()) else item.nodeid.split("::")[0]


def group_for_workers(items) -> None:
    """Give every test its xdist group, the shared engines' or its file's, and on a worker order the
    groups heaviest tier first, each group's tests in their collection order."""
    groups = {item: _group(item) for item in items}
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: next(k for k, prefix in enumerate(FIRST) if groups[item].startswith(prefix)))


def one_core_each() -> None:
    """On a worker: this process's threads, and every process or thread it starts from now on, run on a
    share of the machine's cores of their own (gw0 the first, gw1 the second, ...) with a thread per core."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    cpus = sorted(MACHINE_CPUS)
    if not worker or not count or len(cpus) < int(count):
        return
    _use(set(cpus[int(worker.removeprefix("gw"))::int(count)]))


def _use(cpus: set[int]) -> None:
    import torch

    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), cpus)
        except ProcessLookupError:  # a thread that has just ended
            pass
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    torch.set_num_threads(len(cpus))


@contextmanager
def all_cores() -> Iterator[None]:
    """Every core of the machine for the processes started inside the block (a tensor-parallel engine's
    ranks, a Ray cluster's nodes, which keep them), then this worker's own share again."""
    mine = os.sched_getaffinity(0)
    if mine == MACHINE_CPUS:
        yield
        return
    _use(set(MACHINE_CPUS))
    try:
        yield
    finally:
        _use(mine)


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


def start_shared_server(config) -> None:
    """On xdist's controller, before it starts its workers: the Prefect server they share, started (each
    waits for it to answer when its first test needs it), unless the run is of the unit tier alone."""
    if config.pluginmanager.getplugin("dsession") is None:
        return
    where = [Path(config.invocation_params.dir, arg.split("::")[0]).resolve() for arg in config.args]
    if where and all(path.is_relative_to(TESTS / "unit") for path in where):
        return
    proc, api, _ = start_server()
    config.stash[SERVER] = proc
    os.environ[SHARED_API] = api


def stop_shared_server(config) -> None:
    proc = config.stash.get(SERVER, None)
    if proc is not None:
        stop_server(proc)
