"""Shared fixtures, each defined once here (helpers: tests/support/), and the tiers every test is marked with.
Engines are expensive (seconds to start): one per model per session."""
from __future__ import annotations

import os
import tempfile
import time
from collections import Counter

import pytest

from patchgrid.backends import engine as engine_module
from patchgrid.backends.engine import EnginePool
from tests.support.engines import LIVE_IN_PROCESS, LIVE_OWN_PROCESS, own_processes_of
from tests.support.tiers import mark_tiers
from tests.support.workers import (
    check_grouped,
    group_for_workers,
    one_core_each,
    received_engine_starts,
    send_engine_starts,
    start_shared_server,
    stop_shared_server,
)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Test prompts are short: 1 GiB of KV cache per engine keeps a session's engines within memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Prefect keeps task results under ~/.prefect/storage whatever PREFECT_HOME says: one folder per test
# session, so that no test finds a cached result that an earlier session stored.
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = tempfile.mkdtemp(prefix="patchgrid-prefect-results-")


class CountedPool(EnginePool):
    """The session's pool, counting the engines it starts and their seconds (the summary's `engine
    starts` line): an engine started twice in a session is a test order or a pool bound to mend.
    Its vLLM engines are bounded apart by where they run (tests/support/engines.py): before one starts,
    the least recently used of its kind is closed if the kind is at its bound."""

    starts: list[tuple[str, str, float, str]] = []  # (model, backend and options, seconds, the test that asked)

    def get(self, model, backend=engine_module.DEFAULT_BACKEND, **options):
        if (model, backend, tuple(sorted(options.items()))) in self._engines:
            return super().get(model, backend, **options)
        if backend == "vllm":
            self._make_room_for(own_processes_of(model, options))
        began = time.monotonic()
        engine = super().get(model, backend, **options)
        asked_by = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        self.starts.append((model, f"{backend} {options}" if options else backend, time.monotonic() - began, asked_by))
        return engine

    def _make_room_for(self, own: bool) -> None:
        """Close the least recently used vLLM engines of one kind (in processes of their own or not) until
        one more keeps within its bound."""
        kind = [key for key in self._engines if key[1] == "vllm" and own_processes_of(key[0], dict(key[2])) == own]
        for model, backend, options in kind[:max(0, len(kind) - (LIVE_OWN_PROCESS if own else LIVE_IN_PROCESS) + 1)]:
            self.drop(model, backend, **dict(options))


@pytest.fixture(scope="session")
def engines():
    """The session's engines (patchgrid.backends.engine.EnginePool), started on first use and shared by every test."""
    with CountedPool() as pool:
        yield pool


def pytest_configure(config):
    one_core_each()  # on a worker of `make test` (tests/support/workers.py)


@pytest.hookimpl(tryfirst=True)  # before xdist starts its workers, which inherit the server's address
def pytest_sessionstart(session):
    start_shared_server(session.config)


def pytest_sessionfinish(session):
    send_engine_starts(session.config, CountedPool.starts)
    stop_shared_server(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """A worker's engine starts (tests/support/workers.py), for the summary's `engine starts` line."""
    CountedPool.starts.extend(received_engine_starts(node))


def pytest_terminal_summary(terminalreporter):
    starts = CountedPool.starts
    if not starts:
        return
    again = Counter((model, how) for model, how, *_ in starts)
    twice = sorted(f"{model} ({how}) x{n}, by " + ", ".join(test for m, h, _, test in starts if (m, h) == (model, how))
                   for (model, how), n in again.items() if n > 1)
    terminalreporter.write_line(f"engine starts: {len(starts)} in {sum(s for _, _, s, _ in starts):.0f} s"
                                + (f"; started more than once: {'; '.join(twice)}" if twice else ""))


@pytest.fixture(scope="session")
def tokenizers():
    from transformers import AutoTokenizer

    from patchgrid.model.models import prepare

    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = AutoTokenizer.from_pretrained(prepare(model))
        return cache[model]

    return get


@pytest.fixture(scope="session")
def tok(tokenizers):
    """smollm2-135m's tokenizer (the pairs' tests)."""
    return tokenizers("smollm2-135m")


@pytest.fixture(scope="session", autouse=True)
def prefect_server_api(request):
    """The session's Prefect server (tests/support/prefect_server.py): the API that flow runs in
    processes of their own report to (PREFECT_API_URL, inherited), started once for every test but
    those of the unit tier, which need none; under `make test`, the one its workers share."""
    if all(item.get_closest_marker("unit") for item in request.session.items):
        yield None
        return
    from tests.support.prefect_server import session_prefect_server

    with session_prefect_server() as api:
        patch = pytest.MonkeyPatch()
        patch.setenv("PREFECT_API_URL", api)
        yield api
        patch.undo()


@pytest.fixture(scope="module")
def prefect_api(prefect_server_api):
    """The session's Prefect API for the module's flow runs in this process. Their heartbeats off:
    Prefect joins a flow's heartbeat thread as the flow ends, which sleeps in one-second steps (0.5 s a
    flow on average); no test here reads a heartbeat."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server_api, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@pytest.fixture(autouse=True)
def _unit_tests_start_no_engine(request, monkeypatch):
    """A test of the unit tier that starts an engine in process fails, naming what to do instead."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(model, *args, **kwargs):
        raise AssertionError(f"a unit test started an engine ({model}): use the engines fixture, whose tests "
                             "are the engine tier")

    monkeypatch.setattr(engine_module, "load_engine", refuse)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (`make test` runs two workers)
def pytest_collection_modifyitems(config, items):
    mark_tiers(items)
    group_for_workers(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    check_grouped(node.config, ids)
