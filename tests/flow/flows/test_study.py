"""The study flow, run by real Prefect (a temporary API and database), on a real vLLM engine and a
real DuckDB file."""
from __future__ import annotations

import asyncio

import pytest

from patchgrid.metrics import METRICS
from patchgrid.pipeline.spec import StudySpec
from patchgrid.sweeps import SweepConfig, count_runs
from patchgrid.warehouse.loader import query
from tests.support.engines import needs_vllm
from tests.support.pairs import DATA
from tests.support.task_runs import task_states

pytestmark = needs_vllm


def _artifacts():
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            return await client.read_artifacts()

    return asyncio.run(read())


def _task_states(flow_run_id, names, timeout=60.0):
    """The final state of each named task run of a flow run (each runs once here)."""
    return {name: ",".join(sorted(states)) for name, states in task_states(flow_run_id, names, timeout).items()}


def test_study_end_to_end_then_rerun_replaces(prefect_api, tmp_path):
    from patchgrid.flows.study import study

    wh = str(tmp_path / "w.duckdb")
    params = dict(model="tiny-llama", pairs=str(DATA), sweeps="resid,heads,trace", limit=4, warehouse=wh,
                  workdir=str(tmp_path / "work"), require_known=False, trace_samples=2, shard_size=3)
    state = study(StudySpec.of(**params), return_state=True)
    run_id = state.result()
    assert run_id.startswith("run-")

    # every input record, accepted or rejected, with the run's baselines and effects
    assert query(wh, "SELECT count(*) FROM pairs WHERE run_id = ?", [run_id])[1][0][0] == 1157
    assert query(wh, "SELECT count(*) FROM baselines WHERE run_id = ?", [run_id])[1][0][0] == 4
    from patchgrid.pairs import accepted_pairs, read_pairs, traced_facts

    table = read_pairs(tmp_path / "work" / "runs" / run_id / "pairs.parquet")
    pairs, facts = accepted_pairs(table, 4), traced_facts(table, 4)
    assert facts  # tracing runs on the facts the model knows alone, not on the accepted pairs
    n_effects = query(wh, "SELECT count(*) FROM effects WHERE run_id = ?", [run_id])[1][0][0]
    trace_rows = sum(3 * 4 * len(f.clean_ids) for f in facts)  # one per restored site, samples averaged
    assert n_effects == count_runs(pairs, SweepConfig(sweeps=("resid", "heads")), 4, 4) + trace_rows
    traced = query(wh, "SELECT DISTINCT pair_id FROM effects WHERE run_id = ? AND sweep = 'trace' ORDER BY 1",
                   [run_id])[1]
    assert traced == sorted((f.pair_id,) for f in facts)
    traced = query(wh, "SELECT params->>'traced' FROM runs")[1][0][0]
    assert traced.startswith("facts the model knows alone by the run's trace_facts rule")
    status = query(wh, "SELECT status, model, flow_run_id FROM runs WHERE run_id = ?", [run_id])[1][0]
    assert status[0] == "completed" and status[1] == "tiny-llama" and status[2]
    assert query(wh, "SELECT count(*) FROM rejections WHERE run_id = ?", [run_id])[1][0][0] >= 1
    # answers of several tokens are scored whole (the default policy): every metric column is filled,
    # the logit difference only where both answers are one token, and every view names its metric
    policies = dict(query(wh, "SELECT answer_policy, count(*) FROM pairs WHERE run_id = ? AND pair_id IN "
                              "(SELECT pair_id FROM effects WHERE run_id = ?) GROUP BY ALL", [run_id, run_id])[1])
    assert policies.get("full", 0) >= 1, policies  # tiny-llama's tokenizer spells most answers out
    missing = query(wh, "SELECT " + ", ".join(f"count(*) - count(patched_{m})" for m in METRICS if m != "logit_diff") +
                    " FROM effects WHERE run_id = ?", [run_id])[1][0]
    assert set(missing) == {0}
    whole = query(wh, "SELECT count(patched_logit_diff), count(patched_logprob_diff), count(patched_kl) FROM effects "
                      "e JOIN pairs p USING (run_id, pair_id) WHERE run_id = ? AND p.answer_policy = 'full'",
                  [run_id])[1][0]
    assert whole[0] == 0 and whole[1] == whole[2] > 0
    summarised = {r[0] for r in query(wh, "SELECT DISTINCT metric FROM effect_summary WHERE run_id = ?", [run_id])[1]}
    assert summarised == set(METRICS) - ({"logit_diff"} if "single" not in policies else set())
    keys = {a.key for a in _artifacts()}
    assert "study-summary" in keys and any(k.startswith("sweeps-") for k in keys)

    # the same study again: the same run, found in the caches, replacing its rows
    state2 = study(StudySpec.of(**params), return_state=True)
    assert state2.result() == run_id
    tasks = _task_states(state2.state_details.flow_run_id, ("cache_activations", "align_pairs"))
    assert tasks["cache_activations"] == "CACHED" and tasks["align_pairs"] == "CACHED"
    assert query(wh, "SELECT count(*) FROM effects WHERE run_id = ?", [run_id])[1][0][0] == n_effects
    assert query(wh, "SELECT count(*) FROM runs")[1][0][0] == 1

    # every layer of every patched run (--no-start-midstack): a run of its own, the same numbers (exactly, in float32)
    full_id = study(StudySpec.of(**params, start_midstack=False))
    assert full_id != run_id
    same = " AND ".join(f"a.{c} IS NOT DISTINCT FROM b.{c}" for c in
                        ("pair_id", "sweep", "site", "direction", "layer", "position", "head", "window"))
    worst = ", ".join(f"max(abs(a.patched_{m} - b.patched_{m}))" for m in METRICS)
    n, *worst = query(wh, f"SELECT count(*), {worst} FROM effects a JOIN effects b ON {same} "
                          f"WHERE a.run_id = ? AND b.run_id = ?", [run_id, full_id])[1][0]
    assert n == n_effects and all(w == 0 for w in worst if w is not None) and worst.count(None) <= 1
    assert query(wh, "SELECT params->>'start_midstack' FROM runs WHERE run_id = ?", [full_id])[1][0][0] == "false"


def test_flow_parameters_are_checked_at_the_edge(prefect_api, tmp_path):
    from prefect.exceptions import ParameterTypeError

    from patchgrid.flows.study import study

    # the flow's one parameter, as a deployment or the API gives it: JSON, checked when the spec is built
    with pytest.raises(ParameterTypeError, match="unknown sweep 'bogus'"):
        study({"model": "tiny-llama", "sweep": {"sweeps": ["resid", "bogus"]}, "warehouse": str(tmp_path / "w.duckdb")})
    with pytest.raises(ParameterTypeError, match="limit 0 must be at least 1"):
        study({"model": "tiny-llama", "limit": 0, "warehouse": str(tmp_path / "w.duckdb")})
    with pytest.raises(ParameterTypeError, match="colour"):  # a setting that does not exist is named too
        study({"model": "tiny-llama", "colour": "red"})
