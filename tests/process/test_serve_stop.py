"""`patchgrid serve` stops on its first stop signal, as a terminal sends it (Ctrl-C: SIGINT to the whole
process group) and as a scheduler does (SIGTERM to the command's process alone), leaving no process: not
its Prefect server, not its supervised child (patchgrid/cli/supervise.py). Both served at once, on a cron
far in the future, each with its own Prefect server on a free port; the one stopped by SIGTERM has a run in
flight, made by hand, which is stopped too and recorded as cancelled. The one stopped by Ctrl-C is served
with a limit and an overlap of its own, which its deployment is read back with before it stops (the
default's, and the skip it makes, shown by tests/process/flows/test_schedule.py; prefect.yaml's:
tests/flow/flows/test_schedule_overlap.py; a limit below one refused: tests/unit/cli/test_refusals.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from patchgrid.warehouse.loader import query
from tests.support.pairs import DATA
from tests.support.prefect_server import free_port
from tests.support.processes import kill_sessions, left_in, sessions_of, wait_for

NEVER_DUE = "0 0 1 1 *"  # midnight on the first of January
STOP_S = 15  # the runner's shutdown (pausing the deployment), then the Prefect server's


def _serve(tmp_path, name: str, *extra: str):
    home, port = tmp_path / name, free_port()
    home.mkdir()
    env = dict(os.environ, PREFECT_HOME=str(home / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)
    log = open(home / "serve.log", "w+")  # read as the test goes; closed by the fixture
    proc = subprocess.Popen([sys.executable, "-m", "patchgrid", "serve", "--cron", NEVER_DUE, "--model", "tiny-llama",
                             "--backend", "hf", "--pairs", str(DATA), "--no-require-known",
                             "--warehouse", str(home / "w.duckdb"), "--workdir", str(home / "work"),
                             "--port", str(port), *extra],
                            env=env, cwd=home, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, log, port, home / "w.duckdb"


def _serving(proc, log) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"serve exited ({proc.returncode}) before serving:\n{_text(log)[-3000:]}")
    return "serving the deployment" in _text(log)


def _text(log) -> str:
    log.seek(0)
    return log.read()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Two `serve` commands, each serving its deployment, the second with a run in flight (mid-sweep), with the
    sessions of everything they started."""
    tmp_path = tmp_path_factory.mktemp("serve")
    # the run in flight must outlast the Ctrl-C test that goes first (up to STOP_S) on a quick CPU too: 16 pairs
    # once ended before its SIGTERM came
    both = {"ctrl_c": _serve(tmp_path, "ctrl_c", "--limit", "1", "--sweeps", "resid", "--concurrency-limit", "2",
                             "--on-overlap", "wait"),
            "sigterm": _serve(tmp_path, "sigterm", "--limit", "64", "--sweeps", "resid,heads")}
    sessions = {}
    try:
        for how, (proc, log, _, _) in both.items():
            wait_for(lambda proc=proc, log=log: _serving(proc, log), 300, what=f"{how}'s serve to start")
        proc, log, port, _ = both["sigterm"]
        _run_until_sweeping(port, proc, log)
        for how, (proc, *_) in both.items():
            sessions[how] = sessions_of(proc)
        yield {how: (proc, log, sessions[how], wh, port) for how, (proc, log, port, wh) in both.items()}
    finally:
        for proc, log, _, _ in both.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            log.close()
        for found in sessions.values():
            kill_sessions(found)


def _run_until_sweeping(port: int, proc, log) -> None:
    """A run of the served deployment, made by hand, followed until one of its sweep tasks runs."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with SyncPrefectClient(f"http://127.0.0.1:{port}/api") as client:
        run = client.create_flow_run_from_deployment(client.read_deployment_by_name("study/patchgrid-study").id)

        def sweeping():
            _serving(proc, log)
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            return any(t.name.startswith("sweep_shard") and t.state and t.state.is_running() for t in tasks)

        wait_for(sweeping, 300, what="the run's sweeps to start")


def _stops(proc, log, sessions, send) -> None:
    assert len(sessions) == 2, f"serve did not run in a session of its own: {sessions}"
    t0 = time.monotonic()
    send(proc.pid)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve still running 60 s after the signal:\n{_text(log)[-3000:]}") from None
    took = time.monotonic() - t0
    time.sleep(0.5)
    left = left_in(sessions)
    print(f"serve stopped in {took:.1f} s")
    assert took <= STOP_S, f"took {took:.1f} s to stop"
    assert left == [], f"left running: {left}"


def test_serve_registers_the_limit_and_overlap_asked_for(served):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy

    proc, log, _, _, port = served["ctrl_c"]
    with SyncPrefectClient(f"http://127.0.0.1:{port}/api") as client:
        deployment = client.read_deployment_by_name("study/patchgrid-study")
    assert deployment.global_concurrency_limit.limit == 2
    assert deployment.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.ENQUEUE
    assert "at most 2 runs at once; a run due while 2 are running waits" in _text(log)


def test_serve_stops_on_the_first_ctrl_c_at_a_terminal(served):
    proc, log, sessions, _, _ = served["ctrl_c"]
    _stops(proc, log, sessions, lambda pid: os.killpg(pid, signal.SIGINT))  # the whole group, once
    assert proc.returncode == 128 + signal.SIGINT
    assert _text(log).strip().splitlines()[-1].startswith("patchgrid: stopped by SIGINT")


def test_serve_stops_on_sigterm_to_its_process_and_its_run_in_flight_is_cancelled(served):
    proc, log, sessions, wh, _ = served["sigterm"]
    _stops(proc, log, sessions, lambda pid: os.kill(pid, signal.SIGTERM))  # as Kubernetes and Slurm send it
    assert proc.returncode == 128 + signal.SIGTERM
    assert _text(log).strip().splitlines()[-1].startswith("patchgrid: stopped by SIGTERM")
    assert query(wh, "SELECT status, reason, finished IS NOT NULL FROM runs")[1] == [
        ("cancelled", "cancelled by SIGTERM", True)]
