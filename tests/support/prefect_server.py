"""One Prefect server for a test session's flow runs in processes of their own.

A study run as a command with no server to talk to starts Prefect's temporary server and, in a fresh
PREFECT_HOME, migrates its database first: about 12 s of each CLI study in the tests (measured: 22.5 s
against 10.5 s for a one-pair study on the hf backend). The tests' studies report to this server
instead, as a researcher's do to the server of a cluster or a schedule (so does the example notebook's
kernel, tests/engine/docs/test_notebook.py). The temporary server's own path stays tested where it is the
point: tests/process/test_concurrency.py (two studies migrating one PREFECT_HOME at once), and the
`serve` tests, which start their own.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from patchgrid.runtime.serving import wait_healthy

STARTUP_TIMEOUT_S = 180  # a fresh database migrated and the API answering, on a busy machine


def free_port() -> int:
    """A loopback port free at this moment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Under `make test`'s two workers (tests/support/workers.py) the controller starts one server before it
# starts them, and they inherit its API here: one server's start and upkeep instead of one a worker.
SHARED_API = "PATCHGRID_TESTS_PREFECT_API"


def start_server() -> tuple[subprocess.Popen, str, Path]:
    """A Prefect server (no UI; its services, which record task runs from their events, on) on loopback,
    in a home of its own, started: its process, its API URL and its log (not waited for)."""
    home = Path(tempfile.mkdtemp(prefix="patchgrid-prefect-server-"))
    port = free_port()
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    log = home / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port), "--no-ui"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/api", log


def stop_server(proc: subprocess.Popen) -> None:
    """The server and everything it started, stopped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextlib.contextmanager
def prefect_server():
    """A Prefect server of this process's own, answering: yields its API URL and stops it on the way out."""
    proc, api, log = start_server()
    try:
        if not wait_healthy(f"{api}/health", proc, STARTUP_TIMEOUT_S, probe_s=5):
            raise RuntimeError(f"the tests' Prefect server did not start (exit {proc.poll()}):\n"
                               + log.read_text(errors="replace")[-3000:])
        yield api
    finally:
        stop_server(proc)


@contextlib.contextmanager
def session_prefect_server():
    """The test session's Prefect API: the one the workers' controller started (SHARED_API), once it
    answers, or a server of this process's own."""
    shared = os.environ.get(SHARED_API)
    if not shared:
        with prefect_server() as api:
            yield api
        return
    if not wait_healthy(f"{shared}/health", None, STARTUP_TIMEOUT_S, probe_s=5):
        raise RuntimeError(f"the Prefect server the workers share ({shared}) did not answer within "
                           f"{STARTUP_TIMEOUT_S} s (its log: patchgrid-prefect-server-*/ in the temp folder)")
    yield shared
