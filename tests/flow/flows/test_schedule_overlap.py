"""Scheduled runs that would overlap (issue 28): a served deployment runs at most `--concurrency-limit` runs at
once (default 1), and a run due while the limit's runs are running is skipped (cancelled; `--on-overlap wait`
has it wait instead). Real processes, as in test_schedule.py: a Prefect server and `patchgrid serve`.

The skip itself, a run due while another runs cancelled without running and no two runs overlapping, is
shown by test_schedule.py's served deployment, after the first minute boundary that test waits for anyway
(test_serve_on_a_cron_schedule_runs_the_study_with_no_hand_made_run_and_skips_a_run_due_while_one_runs); here,
the limit and the overlap asked for, registered as asked, and refused when meaningless.
"""
from __future__ import annotations

import yaml

from tests.process.flows.test_schedule import REPO


def test_prefect_yaml_runs_each_deployment_one_at_a_time_skipping_a_late_run():
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    for dep in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        limit = ConcurrencyLimitConfig.model_validate(dep["concurrency_limit"])
        assert limit.limit == 1 and limit.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW, dep["name"]

