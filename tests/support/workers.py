"""How `make test` shares the suite between its worker processes (pytest-xdist: `-n 3 --dist loadgroup`,
with the lanes below).

Most of a test's time on these machines is one core's: Python in a tiny model's forward, a process
importing torch and vLLM, a Prefect server answering. Some test files mostly wait instead: for a
schedule's minute, a stuck call's timeout, a Ray node's death to be noticed. So the workers are lanes:

- the core lanes (every worker but the last), each on a core of its own with one thread, at a lower
  priority (`nice`): two processes of two threads each on two cores lose more to each other (OpenMP
  threads spinning while the other process has the core) than either gains from its second thread
  on these tiny models; what needs two cores (a tensor-parallel engine's ranks) starts inside
  `all_cores()`;
- the waiting lane (the last worker of three or more), on every core at the usual priority: it runs
  the files marked `waits`, and nothing else, so that what they wait for keeps its pace, while the
  core lanes use what the waiting leaves of the cores.

Every test gets an xdist group:
- the tests that take the session's engines (the `engines` fixture, directly or through another
  fixture) run as one group, in collection order, on one worker, so that each engine starts once, as
  in a run with no workers;
- every other test file is a group of its own (its module fixtures built once), its name marked as
  waiting for the files marked `waits`.

The core lanes take groups heaviest tier first (the shared engines', then the process, flow, engine
and unit tiers, `--no-loadscope-reorder` keeping that order), so that the run ends on small unit
files, not on a worker still busy with a study while another waits.

With fewer than three workers there is no waiting lane (every worker a core lane at the usual
priority); without `-n` (a tier or a file run alone) the groups, lanes and order change nothing. The
engines a worker started reach the controller's summary through xdist's worker output (`engine starts`,
tests/conftest.py). The controller starts the Prefect server the workers share
(tests/support/prefect_server.py) before it starts them, unless it runs the unit tier alone, which
needs none.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from xdist.scheduler import LoadGroupScheduling

from tests.support.prefect_server import SHARED_API, start_server, stop_server
from tests.support.tiers import TESTS

SERVER = pytest.StashKey()  # the controller's shared Prefect server process

SHARED_ENGINES = "engines"  # the xdist group of the tests that take the `engines` fixture
WAITS = "waits"  # the marker of a test file whose time is mostly waiting (pyproject.toml's markers)
WAITING = "waiting:"  # how the group of such a file begins
# the order groups are handed out in: the heaviest first
FIRST = ("tests/process/", "tests/flow/", "tests/engine/", "tests/unit/")
CORE_LANE_NICE = 10  # how much less a core lane's processes weigh than the waiting lane's when both want a core
MACHINE_CPUS = frozenset(os.sched_getaffinity(0))  # every core this process may use, before any is chosen


def _group(item) -> str:
    if "engines" in getattr(item, "fixturenames", ()):
        return SHARED_ENGINES
    file = item.nodeid.split("::")[0]
    return WAITING + file if item.get_closest_marker(WAITS) else file


def _order(item, group: str) -> int:
    """The shared engines' group first, then by tier."""
    return 0 if group == SHARED_ENGINES else 1 + next(k for k, tier in enumerate(FIRST) if item.nodeid.startswith(tier))


def group_for_workers(items) -> None:
    """Give every test its xdist group, the shared engines', a file's or a waiting file's, and on a worker
    order the groups heaviest tier first, each group's tests in their collection order."""
    groups = {item: _group(item) for item in items}
    for item, group in groups.items():
        item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: _order(item, groups[item]))


def is_waiting_lane(worker: str | None, count: int) -> bool:
    """The last worker of three or more."""
    return count >= 3 and worker == f"gw{count - 1}"


class Lanes(LoadGroupScheduling):
    """xdist's `--dist loadgroup`, each group handed to its lane: the waiting lane takes the waiting
    groups, and stops once none is left (a third process wanting a core would only slow the two that
    have one); a core lane the first group that is not waiting, or, when none is left, the first left."""

    def _assign_work_unit(self, node) -> None:
        groups = list(self.workqueue)
        waits = is_waiting_lane(node.workerinput["workerid"], int(node.workerinput["workercount"]))
        mine = [group for group in groups if group.startswith(WAITING) == waits]
        if waits and not mine:
            node.shutdown()  # it ends the tests it was given
            return
        self.workqueue.move_to_end(mine[0] if mine else groups[0], last=False)
        super()._assign_work_unit(node)


def one_core_each() -> None:
    """On a core lane: this process's threads, and every process or thread it starts from now on, run on a
    share of the machine's cores of their own (gw0 the first, gw1 the second, ...) with a thread per core,
    at a lower priority where a waiting lane runs beside them. The waiting lane keeps every core."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or is_waiting_lane(worker, int(count)):
        return
    lanes = int(count) - 1 if int(count) >= 3 else int(count)
    cpus = sorted(MACHINE_CPUS)
    if len(cpus) < lanes:
        return
    _use(set(cpus[int(worker.removeprefix("gw")) % lanes::lanes]))
    if lanes < int(count):
        os.nice(CORE_LANE_NICE)


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
