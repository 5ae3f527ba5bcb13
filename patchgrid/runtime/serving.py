"""For `patchgrid serve`: a Prefect server on loopback, when the user has none configured; how many runs
of the served deployment may run at once, and what becomes of a run due while that many are running; the
flow served until the first SIGINT or SIGTERM."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

DEFAULT_CONCURRENCY_LIMIT = 1
# What a run due while the limit's runs are running does, by Prefect's collision strategy: it waits
# for a slot (retried every PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS), or it is
# cancelled at once ("Deployment concurrency limit reached.").
ON_OVERLAP = {"wait": "ENQUEUE", "skip": "CANCEL_NEW"}
DEFAULT_ON_OVERLAP = "skip"
RUNS_STOP_S = 20.0  # from the stop signal, how long the flow runs in flight have to stop as a study does
_FATE = {"wait": "waits", "skip": "is skipped"}


def concurrency_limit(limit: int, on_overlap: str):
    """The served deployment's concurrency limit, as Prefect takes it."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    return ConcurrencyLimitConfig(limit=limit, collision_strategy=ConcurrencyLimitStrategy[ON_OVERLAP[on_overlap]])


def overlap_line(limit: int, on_overlap: str) -> str:
    """What `serve` says of overlapping runs as it starts."""
    runs, are = ("run", "is") if limit == 1 else ("runs", "are")
    return f"at most {limit} {runs} at once; a run due while {limit} {are} running {_FATE[on_overlap]}"


def serve(flow, *, name: str, **deployment) -> None:
    """Serve `flow` as the deployment `name` (Runner.add_flow's keywords: cron, parameters, concurrency_limit)
    from this process, as Flow.serve does, until the first SIGINT or SIGTERM. Either first sends SIGTERM to every
    flow run this process started (each stops as a study does, recorded cancelled; the runner waits for them),
    then goes to the handler the signal had before (patchgrid.runtime.stopping's, under the CLI: Cancelled, raised
    here). Prefect's own SIGTERM handler would stop the runner without stopping its runs, and exit 0."""
    from prefect.runner import Runner

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def stop(signum, frame):
        for run in multiprocessing.active_children():  # the flow runs, started by Prefect with spawn
            run.terminate()
        handler = before[signal.Signals(signum)]
        if callable(handler):
            handler(signum, frame)
        elif handler != signal.SIG_IGN:  # no Python handler: the signal's default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    class StoppingRunner(Runner):
        def handle_sigterm(self, signum, frame):  # installed by Runner.start
            stop(signum, frame)

    runner = StoppingRunner(name=name, pause_on_shutdown=True, limit=None)
    runner.add_flow(flow, name=name, **deployment)
    print(f"serving the deployment {flow.name}/{name} until SIGINT (Ctrl-C) or SIGTERM", file=sys.stderr)
    signal.signal(signal.SIGINT, stop)
    try:
        asyncio.run(runner.start())
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        _wait_for_runs()  # while the Prefect server is there to take their final states


def _wait_for_runs(timeout_s: float = RUNS_STOP_S) -> None:
    """Wait for the flow runs this process started, sent SIGTERM, to end; kill those still running after
    `timeout_s`. (The runner, stopped, no longer waits for them; multiprocessing would, at exit, with no
    timeout, and the runs wait on the Prefect server, which goes once `serve` has returned.)"""
    deadline = time.monotonic() + timeout_s
    for run in multiprocessing.active_children():
        run.join(max(0.0, deadline - time.monotonic()))
        if run.is_alive():
            print(f"patchgrid: flow run process {run.pid} still running {timeout_s:.0f} s after SIGTERM; killed",
                  file=sys.stderr)
            run.kill()
            run.join()


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, every_s: float = 0.5,
                 probe_s: float = 2.0) -> bool:
    """Whether the server `proc` started answers `url` (a health endpoint) with 200 within `timeout_s`,
    asked every `every_s`, each ask waiting `probe_s` at most; False as soon as `proc` exits
    (proc.returncode then says how) or once the time is up (it is still None). `proc` None: a server
    another process started, waited for until the time is up."""
    deadline = time.monotonic() + timeout_s
    while proc is None or proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=probe_s) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return False


@contextmanager
def local_prefect_server(port: int = 4200, timeout_s: float = 90.0):
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    url = f"http://127.0.0.1:{port}/api"
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        if not wait_healthy(f"{url}/health", proc, timeout_s):
            if proc.returncode is not None:
                raise RuntimeError(f"the local Prefect server exited with code {proc.returncode} "
                                   f"(is port {port} taken? use --port)")
            raise RuntimeError(f"the local Prefect server did not answer on {url} within {timeout_s:.0f} s")
        os.environ["PREFECT_API_URL"] = url
        print(f"Prefect server on {url} (UI at http://127.0.0.1:{port})", file=sys.stderr)
        yield url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
