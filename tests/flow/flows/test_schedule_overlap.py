"""Scheduled runs that would overlap, in prefect.yaml: each deployment runs one run at a time,
and a run due while it runs is skipped (Prefect's CANCEL_NEW), as Prefect's own schema reads the
file. `patchgrid serve`'s limit and overlap, registered as asked: tests/process/test_serve_stop.py.
"""
from __future__ import annotations

import yaml

from tests.support.paths import REPO


def test_prefect_yaml_runs_each_deployment_one_at_a_time_skipping_a_late_run():
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    for dep in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        limit = ConcurrencyLimitConfig.model_validate(dep["concurrency_limit"])
        assert limit.limit == 1 and limit.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW, dep["name"]

