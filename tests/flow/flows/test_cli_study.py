"""`patchgrid study`, `query` and `serve` as a researcher runs them: real processes."""
from __future__ import annotations

import yaml

from tests.support.paths import REPO

REPO = REPO


def test_prefect_yaml_deploys_the_study_flow_on_cron_schedules():
    from cronsim import CronSim

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert spec["definitions"]["schedules"]
    for dep in spec["deployments"]:
        path, name = dep["entrypoint"].split(":")
        assert (REPO / path).is_file() and name == "study"
        assert dep["work_pool"]["name"] == "patchgrid-local"
        for sched in dep["schedules"]:
            CronSim(sched["cron"], __import__("datetime").datetime(2026, 1, 1))
        assert dep["parameters"]["spec"]["pairs"] == "data/pairs/facts.jsonl"
    from patchgrid.flows.study import study

    # the flow's parameters as Prefect validates them for a deployment: every setting a StudySpec
    for dep in spec["deployments"]:
        assert set(dep["parameters"]) == set(study.parameters.properties) == {"spec"}
        checked = study.validate_parameters(dep["parameters"])["spec"]
        assert checked.sweeps == tuple(dep["parameters"]["spec"]["sweep"]["sweeps"])

