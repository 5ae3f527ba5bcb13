"""A few studies rerun in the same work folder with one setting (or several) changed: the rerun
completes, the steps whose output depends on the change are computed again and the others are found
cached by Prefect, and a rerun that is the same run gives the same numbers. Every setting is held to
its steps at the level of the tasks' cache keys in tests/engine/pipeline/test_task_keys.py (the
expectations: tests/support/reruns.py); these reruns show that Prefect finds its results by those keys:
a change that leaves every step cached (the run's labels and the engines' sizes, together), one that
recomputes the sweeps alone (the shard size), one that recomputes every step (the noise scale), and
another warehouse."""
from __future__ import annotations

import shutil

import pytest

from patchgrid.pipeline.spec import StudySpec
from patchgrid.warehouse.loader import query
from tests.support.reruns import BASE, TOGETHER, expected, identity_params, rerun_spec
from tests.support.task_runs import task_states

CASES = ["+".join(TOGETHER), "shard_size", "trace_noise_scale", "warehouse"]


@pytest.fixture(scope="module")
def base_run(prefect_api, tmp_path_factory):
    from patchgrid.flows.study import study

    tmp = tmp_path_factory.mktemp("rerun")
    spec = StudySpec.of(**BASE, warehouse=str(tmp / "w.duckdb"), workdir=str(tmp / "work"))
    run_id = study(spec)
    return spec, run_id, tmp


def _effects(warehouse, run_id):
    sql = ("SELECT pair_id, sweep, site, direction, layer, position, head, receiver, patched_logprob_diff "
           "FROM effects WHERE run_id = ? ORDER BY ALL")
    return query(warehouse, sql, [run_id])[1]


@pytest.mark.parametrize("case", CASES)
def test_a_rerun_computes_again_what_depends_on_the_change_and_finds_the_rest(base_run, case, tmp_path):
    from patchgrid.flows.study import study

    spec, base_id, _ = base_run
    names = case.split("+")
    recomputed, cached = expected(case)
    changed = rerun_spec(spec, case, tmp_path)
    if case == "warehouse":
        shutil.copy(spec.warehouse, changed.warehouse)
    state = study(changed, return_state=True)
    run_id = state.result()  # the rerun completes
    states = task_states(state.state_details.flow_run_id)
    for step in recomputed:
        assert "COMPLETED" in states.get(step, set()), f"{case}: {step} was not computed again ({states})"
    for step in cached:
        assert states.get(step, {"CACHED"}) == {"CACHED"}, f"{case}: {step} was computed again ({states})"
    identifies = any(n in identity_params(spec) or n in identity_params(changed) for n in names)
    assert (run_id != base_id) == identifies, case
    params = query(changed.warehouse, "SELECT params FROM runs WHERE run_id = ?", [run_id])[1][0][0]
    for name in names:
        if name in changed.recorded_params() and not identifies:
            assert name in params, f"{name} is not in the run's recorded parameters: {params}"
    if not identifies:  # the same run: its numbers did not change
        assert _effects(changed.warehouse, run_id) == _effects(spec.warehouse, base_id)
