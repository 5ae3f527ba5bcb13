"""Scheduled studies, as users rely on them: with no hand-made run, a cron schedule alone gets a
study run created by Prefect's scheduler, run, and loaded into the warehouse. Real processes: `patchgrid
serve` with the Prefect server it starts, or `prefect deploy` and a process worker on the session's server.

A cron schedule fires at minute boundaries, so the served deployment's test (the one on a real cron
schedule) waits up to a minute for its run; the prefect.yaml deployment runs on a schedule of seconds
(`interval`), which Prefect's scheduler handles as it does a cron one. The study itself (tiny-llama,
one pair, one sweep) takes under a minute. Once the first run has started, the deployment is paused,
so that no second run is running when the processes are stopped.
The served deployment's test also shows what a run due while another runs meets (other limits and
overlaps, registered as asked: test_serve_stop.py): on the same server, after the same wait for the first
minute boundary, which is most of such a test's time.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from patchgrid.runtime.serving import overlap_line
from patchgrid.warehouse.loader import query
from tests.support.engines import needs_vllm
from tests.support.pairs import DATA
from tests.support.paths import REPO
from tests.support.prefect_server import free_port

EVERY_MINUTE = "* * * * *"
EVERY_FEW_SECONDS = 10  # the prefect.yaml deployment's schedule in the test: an interval, in seconds
# the hf backend: what is scheduled is the point here, not the engine (which starts in a second on hf)
STUDY = {"model": "tiny-llama", "pairs": str(DATA), "limit": 1, "require_known": False, "backend": "hf",
         "sweep": {"sweeps": ["resid"]}}
UP_TIMEOUT_S = 120  # a server answering, a deployment registered
START_TIMEOUT_S = 150  # from registration to the first run starting: the next minute boundary, and polling
RUN_TIMEOUT_S = 240  # the study itself
# A run of the served deployment that outlasts the one-minute interval on any machine, at no cost of CPU: its
# data set is a named pipe that nothing writes, so the run, started, waits at reading its pairs (a study's data
# arriving slowly, as from a network share) until it is cancelled, once the run due while it runs has been settled.
LONG_RUN_PIPE = "pairs-never-written.jsonl"
LATE_TIMEOUT_S = 150  # from the schedule's resumption to the next due run settled: a minute boundary, polling
LIMIT_REACHED = "Deployment concurrency limit reached."


def prefect_env(tmp_path: Path, **extra: str) -> dict:
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"),
               PREFECT_RUNNER_POLL_FREQUENCY="2",  # `serve` looks for due runs every 2 s, not 10
               PREFECT_WORKER_QUERY_SECONDS="2",  # and so does the worker
               PREFECT_SERVER_ANALYTICS_ENABLED="false")  # no telemetry calls from an offline test
    env.pop("PREFECT_API_URL", None)
    env.update(extra)
    return env


class Processes:
    """Processes started in their own sessions, logging to files; all stopped (with everything they started,
    Prefect's server, flow-run subprocesses, vLLM's workers) however the test ends."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, name: str, args: list[str], env: dict, cwd: Path) -> subprocess.Popen:
        log = self.tmp_path / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}" for _, log in self.procs)

    def check_alive(self) -> None:
        for proc, log in self.procs:
            if proc.poll() is not None:
                raise AssertionError(f"{log.stem} exited with {proc.returncode}\n{self.logs()}")

    def stop_all(self) -> None:
        for proc, _ in reversed(self.procs):
            stop(proc)
        self.procs.clear()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL whatever is left of it and of the process's descendants."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in family:  # those that left the group (psutil refuses a pid that was reused)
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


def wait_for(what: str, fn, timeout: float, processes: Processes, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        processes.check_alive()
        try:
            found = fn()
        except Exception:  # the server is not up yet, or restarting a connection
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{processes.logs()}")
        time.sleep(every)


def wait_for_scheduled_run(client, deployment, processes: Processes, cron: bool = True):
    """The first run of the deployment, followed to its final state; no run is ever created here.
    `cron`: its schedule is a cron one (its runs are due at whole minutes)."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    def runs():
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))

    def started():
        return [r for r in runs() if r.state and not r.state.is_scheduled()]

    # the earliest due: a later one, due while it runs, is turned away (the deployment's limit of one run)
    first = min(wait_for("the schedule's first run to start (none is created when the server's scheduler fails)",
                         started, START_TIMEOUT_S, processes), key=lambda r: r.expected_start_time)
    client.pause_deployment(deployment.id)  # removes the runs scheduled after it; leaves this one running

    def final():
        run = client.read_flow_run(first.id)
        return run if run.state.is_final() else None

    run = wait_for("the scheduled run to finish", final, RUN_TIMEOUT_S, processes, every=2)
    assert run.state.is_completed(), f"{run.state}\n{processes.logs()}"
    assert run.auto_scheduled, "the run was not created by the scheduler"
    if cron:
        assert run.expected_start_time.second == 0 and run.expected_start_time.microsecond == 0  # a cron time
    assert all(r.auto_scheduled for r in runs())  # nothing but the scheduler made runs
    return run


def assert_warehouse_holds_one_completed_run(warehouse: Path) -> None:
    (_, runs) = query(warehouse, "SELECT run_id, status FROM runs")
    assert len(runs) == 1, runs
    run_id, status = runs[0]
    assert run_id.startswith("run-") and status == "completed", runs
    (_, [(n,)]) = query(warehouse, "SELECT count(*) FROM effects WHERE run_id = ?", [run_id])
    assert n > 0, n


def start_serve(processes: Processes, tmp_path: Path, port: int, *args: str) -> str:
    """`patchgrid serve` on a Prefect server of its own; that server's API."""
    processes.start("serve", [sys.executable, "-m", "patchgrid", "serve", "--warehouse", str(tmp_path / "w.duckdb"),
                              "--workdir", str(tmp_path / "work"), "--port", str(port), *args],
                    env=prefect_env(tmp_path), cwd=tmp_path)
    return f"http://127.0.0.1:{port}/api"


def served_deployment(client, processes: Processes):
    return wait_for("the served deployment", lambda: client.read_deployment_by_name("study/patchgrid-study"),
                    UP_TIMEOUT_S, processes)


def serve_log(processes: Processes) -> str:
    return (processes.tmp_path / "serve.log").read_text(errors="replace")


def deployment_runs(client, deployment) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    found = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
    return sorted(found, key=lambda r: r.expected_start_time)


def took_the_slot(client, run) -> bool:
    """Whether the run ever left its schedule to run (pending, then running), rather than being turned away."""
    return any(s.type.value in ("PENDING", "RUNNING") for s in client.read_flow_run_states(run.id))


def assert_never_two_at_once(client, runs) -> None:
    """No two runs' times from taking the slot (pending) to their end overlap. Not the API's start_time:
    a run cancelled before it ran is given one, its end time."""
    def taken(run):
        return min((s.timestamp for s in client.read_flow_run_states(run.id) if s.type.value in ("PENDING", "RUNNING")),
                   default=None)

    ran = sorted(((t, r) for r in runs if (t := taken(r)) is not None), key=lambda tr: tr[0])
    for (since, before), (after_since, after) in zip(ran, ran[1:]):
        assert before.end_time is not None and before.end_time <= after_since, \
            f"{before.name} ({since}..{before.end_time}) overlaps {after.name} (from {after_since})"


@needs_vllm
def test_serve_on_a_cron_schedule_runs_the_study_with_no_hand_made_run_and_skips_a_run_due_while_one_runs(
        tmp_path, processes):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy

    api = start_serve(processes, tmp_path, free_port(), "--cron", EVERY_MINUTE, "--model", "tiny-llama", "--pairs",
                      str(DATA), "--limit", "1", "--no-require-known", "--sweeps", "resid", "--backend", "hf")
    with SyncPrefectClient(api) as client:
        deployment = served_deployment(client, processes)
        assert [s.schedule.cron for s in deployment.schedules] == [EVERY_MINUTE]
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW
        assert overlap_line(1, "skip") == "at most 1 run at once; a run due while 1 is running is skipped"
        assert overlap_line(1, "skip") in serve_log(processes)
        scheduled = wait_for_scheduled_run(client, deployment, processes)  # and the deployment paused
        long_run, late = skip_a_run_due_while_a_long_one_runs(client, deployment, processes)
        # the late run was turned away while the long run still ran (serve submits a due run 10 s early)
        assert late.state.timestamp < long_run.end_time, \
            f"the long run ended before the next run was settled, in {long_run.total_run_time}: it waits on a pipe"
        assert late.state.is_cancelled() and late.state.message == LIMIT_REACHED, late.state
        history = [s.type.value for s in client.read_flow_run_states(late.id)]
        assert history == ["SCHEDULED", "CANCELLED"], history  # it never ran
        assert late.auto_scheduled
        runs = deployment_runs(client, deployment)
        # no run but the scheduled one and the long one ran: the late one was turned away, and so was any
        # other due while the long run ran (on a busy machine its cancelling can outlast another minute)
        assert sorted(str(r.id) for r in runs if took_the_slot(client, r)) == \
            sorted(str(i) for i in (scheduled.id, long_run.id))
        assert_never_two_at_once(client, runs)
    processes.stop_all()  # the warehouse is read with no Prefect process left that could write it
    assert_warehouse_holds_one_completed_run(tmp_path / "w.duckdb")  # the long run wrote elsewhere


def skip_a_run_due_while_a_long_one_runs(client, deployment, processes: Processes):
    """With the deployment paused, a run of it made here that outlasts its schedule's interval (into a warehouse
    of its own); once it runs, the schedule resumed, and the next run due, once settled; then the deployment
    paused again, so that no other starts, and the long run, still running, cancelled and followed until it
    stops. (The long run, its slot taken, and the late run: what the schedule's first run, had it outlasted
    the minute, would have met.)"""
    from prefect.states import Cancelling

    pipe = processes.tmp_path / LONG_RUN_PIPE
    os.mkfifo(pipe)
    spec = {**deployment.parameters["spec"], "pairs": str(pipe), "warehouse": str(processes.tmp_path / "long.duckdb")}
    long_run = client.create_flow_run_from_deployment(deployment.id, parameters={"spec": spec})

    def running():
        run = client.read_flow_run(long_run.id)
        return run if run.state.is_running() else None

    long_run = wait_for("the long run to start", running, START_TIMEOUT_S, processes)
    client.resume_deployment(deployment.id)

    def next_one_settled():
        later = [r for r in deployment_runs(client, deployment)
                 if r.auto_scheduled and r.expected_start_time > long_run.expected_start_time]
        return later[0] if later and later[0].state.is_final() else None

    late = wait_for("the next run due to be settled", next_one_settled, LATE_TIMEOUT_S, processes)
    client.pause_deployment(deployment.id)
    # the long run has shown what it had to: it is cancelled (the runner stops its process); one that has
    # already ended would be forced back to cancelling with no process left to stop
    ended = client.read_flow_run(long_run.id)
    assert not ended.state.is_final(), \
        f"the long run ended ({ended.state.type.value}) before the next run was settled: it waits on a pipe"
    client.set_flow_run_state(long_run.id, Cancelling(), force=True)

    def stopped():
        run = client.read_flow_run(long_run.id)
        return run if run.state.is_final() else None

    long_run = wait_for("the long run to stop", stopped, RUN_TIMEOUT_S, processes, every=2)
    assert not long_run.state.is_completed(), f"the long run completed before it was cancelled: {long_run.state}"
    return long_run, late


def deployment_file(tmp_path: Path, warehouse: Path) -> Path:
    """The shipped prefect.yaml's nightly study, every few seconds, over tiny-llama and one test pair."""
    shipped = yaml.safe_load((REPO / "prefect.yaml").read_text())
    dep = next(d for d in shipped["deployments"] if d["name"] == "nightly-study")
    assert dep["entrypoint"] == "flows/study.py:study"
    dep["schedules"] = [{"interval": EVERY_FEW_SECONDS, "timezone": "UTC"}]
    dep["parameters"] = {"spec": {**STUDY, "warehouse": str(warehouse), "workdir": str(tmp_path / "work")}}
    spec = {"name": shipped["name"], "prefect-version": shipped["prefect-version"], "pull": shipped["pull"],
            "deployments": [dep]}
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def home_repo(cwd: Path) -> Path:
    """The checkout whose flows/ the installed patchgrid imports: what $PATCHGRID_HOME_REPO names. This
    repository, unless the tests run from another checkout than the one installed in editable mode (a git
    worktree): then the flow run would mix one checkout's flows/ with the other's patchgrid/."""
    where = "import importlib.util as u; print(u.find_spec('patchgrid.flows').origin)"
    res = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, timeout=60, cwd=cwd)
    assert res.returncode == 0, res.stderr
    home = Path(res.stdout.strip()).parents[1]
    assert (home / "flows" / "study.py").is_file(), home
    return home


@needs_vllm
def test_prefect_yaml_deployment_with_a_worker_runs_on_its_schedule(tmp_path, processes, prefect_server_api):
    """On the session's Prefect server (a server of a team's own, as the shipped file expects), with a work
    pool and a deployment of this test's, both deleted at its end."""
    from prefect.client.orchestration import SyncPrefectClient

    warehouse, home, api = tmp_path / "w.duckdb", home_repo(tmp_path), prefect_server_api
    env = prefect_env(tmp_path, PREFECT_API_URL=api, PATCHGRID_HOME_REPO=str(home))
    pool = yaml.safe_load((REPO / "prefect.yaml").read_text())["definitions"]["work_pools"]["local"]["name"]

    def prefect(*args, cwd=tmp_path):
        res = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], env=env, cwd=cwd,
                             capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, f"prefect {' '.join(args)}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"

    with SyncPrefectClient(api) as client:
        prefect("work-pool", "create", pool, "--type", "process")
        try:
            # `prefect deploy` loads the entrypoint relative to its folder, the repository, as the shipped
            # file's comment says; the deployment file is the generated one.
            prefect("deploy", "--all", "--prefect-file", str(deployment_file(tmp_path, warehouse)), cwd=home)
            deployment = client.read_deployment_by_name("study/nightly-study")
            try:
                processes.start("worker", [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
                                           "--limit", "1"], env=env, cwd=tmp_path)
                assert [s.schedule.interval.total_seconds() for s in deployment.schedules] == [EVERY_FEW_SECONDS]
                assert deployment.work_pool_name == pool
                run = wait_for_scheduled_run(client, deployment, processes, cron=False)
                assert run.work_pool_name == pool
                processes.stop_all()
            finally:
                client.delete_deployment(deployment.id)  # and its schedule, on a server other tests share
        finally:
            client.delete_work_pool(pool)
    assert_warehouse_holds_one_completed_run(warehouse)
