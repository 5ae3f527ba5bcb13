"""Scheduled runs that would overlap, as `patchgrid serve` registers them: a served deployment
runs at most `--concurrency-limit` runs at once (default 1), and a run due while the limit's runs are
running is skipped (cancelled) or, with `--on-overlap wait`, waits. Real processes, as in test_schedule.py:
a Prefect server and `patchgrid serve`, and the served deployment read back from the server.

The skip itself, a run due while another runs cancelled without running and no two runs overlapping, is
shown by test_schedule.py's served deployment, after the first minute boundary that test waits for anyway
(test_serve_on_a_cron_schedule_runs_the_study_with_no_hand_made_run_and_skips_a_run_due_while_one_runs).
prefect.yaml's deployments: tests/flow/flows/test_schedule_overlap.py; a limit below one refused:
tests/unit/cli/test_refusals.py.
"""
from __future__ import annotations

from tests.process.flows.test_schedule import Processes, serve_log, served_deployment, start_serve
from tests.support.prefect_server import free_port


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

