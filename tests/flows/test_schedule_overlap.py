"""Scheduled runs that would overlap (issue 28): a served deployment runs at most `--concurrency-limit` runs at
once (default 1), and a run due while the limit's runs are running is skipped (cancelled; `--on-overlap wait`
has it wait instead). Real processes, as in test_schedule.py: a Prefect server and `patchgrid serve`.

The study is far longer than its one-minute cron interval (tiny-llama, 400 pairs in shards of one: minutes on
any machine here), so the run due a minute after the first comes due while the first is running (`serve`
submits it 10 s early, PREFECT_RUNNER_PREFETCH_SECONDS, and the server cancels it then). The test waits up to
a minute for the first run, then for that second run to be cancelled, then cancels the first (it has shown
what it had to) and follows it until it stops: about two to three minutes, bounded by BUDGET_S.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

from patchgrid.serving import overlap_line
from tests.flows.test_schedule import EVERY_MINUTE, REPO, UP_TIMEOUT_S, Processes, free_port, prefect_env, wait_for
from tests.support.engines import needs_vllm
from tests.support.pairs import DATA

# The served study: one pair per sweep task, far more pairs than a minute takes on any machine here (a
# quiet one runs about 2.5 pairs a second); it is cancelled once the run due after it has been settled.
LONG_STUDY = ["--model", "tiny-llama", "--pairs", str(DATA), "--limit", "400", "--shard-size", "1",
              "--no-require-known", "--sweeps", "resid"]
BUDGET_S = 270  # the whole test: the server up, a minute boundary, the next one, the processes stopped
LIMIT_REACHED = "Deployment concurrency limit reached."


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
def test_a_run_due_while_the_served_study_runs_is_skipped_and_never_overlaps(tmp_path):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy

    deadline = time.monotonic() + BUDGET_S

    def left() -> float:
        return max(deadline - time.monotonic(), 1.0)

    processes = Processes(tmp_path)
    try:
        api = start_serve(processes, tmp_path, free_port(), "--cron", EVERY_MINUTE, *LONG_STUDY)
        with SyncPrefectClient(api) as client:
            deployment = served_deployment(client, processes)
            assert deployment.global_concurrency_limit.limit == 1
            assert deployment.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW
            assert overlap_line(1, "skip") == "at most 1 run at once; a run due while 1 is running is skipped"
            assert overlap_line(1, "skip") in serve_log(processes)
            first, late = follow_two_runs(client, deployment, processes, left)
            # the late run was turned away while the first still ran (serve submits a due run 10 s early)
            assert late.state.timestamp < first.end_time, \
                f"the study ended before the next run was settled, in {first.total_run_time}: make LONG_STUDY longer"
            assert late.state.is_cancelled() and late.state.message == LIMIT_REACHED, late.state
            history = [s.type.value for s in client.read_flow_run_states(late.id)]
            assert history == ["SCHEDULED", "CANCELLED"], history  # it never ran
            assert late.auto_scheduled
            runs = deployment_runs(client, deployment)
            # no run but the first ran (the late one was turned away; later ones are only scheduled)
            assert [r.id for r in runs if r.id != late.id and r.state.type.value != "SCHEDULED"] == [first.id]
            assert_never_two_at_once(client, runs)
    finally:
        processes.stop_all()


def deployment_runs(client, deployment) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    found = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
    return sorted(found, key=lambda r: r.expected_start_time)


def follow_two_runs(client, deployment, processes: Processes, left):
    """The schedule's first run, and the run due after it, once settled: the deployment is then paused, so
    that no third starts, and the first run, still running, is cancelled and followed until it stops."""
    def running():
        return next((r for r in deployment_runs(client, deployment) if r.state.is_running()), None)

    first = wait_for("the schedule's first run to start", running, min(150, left()), processes)

    def next_one_settled():
        later = [r for r in deployment_runs(client, deployment) if r.expected_start_time > first.expected_start_time]
        return later[0] if later and later[0].state.is_final() else None

    late = wait_for("the run due a minute after the first to be settled", next_one_settled, left(), processes)
    client.pause_deployment(deployment.id)
    from prefect.states import Cancelling

    # the long study has shown what it had to: it is cancelled (the runner stops its process)
    client.set_flow_run_state(first.id, Cancelling(), force=True)

    def first_finished():
        run = client.read_flow_run(first.id)
        return run if run.state.is_final() else None

    first = wait_for("the first run to stop", first_finished, left(), processes, every=2)
    assert not first.state.is_completed(), f"the long study completed before it was cancelled: {first.state}"
    return first, late


def test_serve_registers_the_limit_and_overlap_asked_for(tmp_path):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy

    processes = Processes(tmp_path)
    try:
        api = start_serve(processes, tmp_path, free_port(), "--cron", "0 3 * * *", "--model", "tiny-llama",
                          "--concurrency-limit", "2", "--on-overlap", "wait")
        with SyncPrefectClient(api) as client:
            deployment = served_deployment(client, processes)
        assert deployment.global_concurrency_limit.limit == 2
        assert deployment.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.ENQUEUE
        assert "at most 2 runs at once; a run due while 2 are running waits" in serve_log(processes)
    finally:
        processes.stop_all()


def test_serve_refuses_a_concurrency_limit_below_one(tmp_path):
    res = subprocess.run([sys.executable, "-m", "patchgrid", "serve", "--cron", EVERY_MINUTE, "--model", "tiny-llama",
                          "--concurrency-limit", "0"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 2
    assert "--concurrency-limit 0: at least 1 run must be allowed at once" in res.stderr.strip().splitlines()[-1]


def test_prefect_yaml_runs_each_deployment_one_at_a_time_skipping_a_late_run():
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    for dep in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        limit = ConcurrencyLimitConfig.model_validate(dep["concurrency_limit"])
        assert limit.limit == 1 and limit.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW, dep["name"]
