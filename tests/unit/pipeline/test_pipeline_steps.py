"""The pipeline's steps (patchgrid.pipeline.steps), which the study flow's tasks and `patchgrid sweep`
both call, and the one rule both take a run's default id from."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from patchgrid.pairs import accepted_pairs, build_from_source, read_pairs, write_pairs
from patchgrid.pipeline import steps
from patchgrid.pipeline.fingerprint import fingerprint
from patchgrid.pipeline.spec import StudySpec, default_run_id, run_params
from patchgrid.settings import SpecError
from patchgrid.sweeps import POPULATIONS, SweepConfig, TraceNoise
from patchgrid.warehouse.loader import query
from tests.support.pairs import DATA
from tests.support.reruns import identity_params

SHA = "a" * 64


SWEEP_OWN = {"command": "sweep", "model": "tiny-llama", "pairs_table": "/data/pairs.parquet", "limit": 2,
             "backend": "hf"}


def test_a_study_takes_its_default_run_id_from_the_one_rule():
    spec = StudySpec.of(model="tiny-llama", sweeps="resid,trace", limit=2)
    run_id = spec.default_run_id(SHA)
    # the rule as it has always been: a rerun after an upgrade finds its run and replaces its rows
    assert run_id == "run-" + fingerprint(SHA, identity_params(spec))[:12]
    # how engines were sized and a run's labels leave the numbers alone, so the id too
    assert spec.replace(max_num_seqs=64, name="a label").default_run_id(SHA) == run_id
    assert spec.replace(seed=1).default_run_id(SHA) != run_id
    assert spec.replace(trace_samples=3).default_run_id(SHA) != run_id
    assert spec.default_run_id("b" * 64) != run_id  # other weights, another run


def test_the_sweep_command_and_a_study_share_the_rule():
    config = SweepConfig(sweeps=("resid", "trace"), trace_samples=2)
    sweep_id = default_run_id("sweep", SHA, SWEEP_OWN, config)
    assert sweep_id.startswith("sweep-") and len(sweep_id) == len("sweep-") + 12
    # the same inputs under either prefix: the same fingerprint
    assert sweep_id.removeprefix("sweep-") == default_run_id("run", SHA, SWEEP_OWN, config).removeprefix("run-")
    assert default_run_id("sweep", SHA, {**SWEEP_OWN, "limit": 3}, config) != sweep_id
    # a sweep kind's settings count where the kind runs, and the recorded parameters are the identity's
    # and the noted ones
    assert "verify_top" in run_params(SWEEP_OWN, SweepConfig(sweeps=("atp",)), noted=False)
    assert "verify_top" not in run_params(SWEEP_OWN, config, noted=False)
    assert run_params(SWEEP_OWN, config) == run_params(SWEEP_OWN, config, noted=False)  # none of these is noted


def test_now_and_the_code_version():
    import patchgrid

    stamp = steps.now()
    assert stamp.tzinfo is None
    assert abs(stamp - datetime.now(timezone.utc).replace(tzinfo=None)) < timedelta(seconds=5)
    assert steps.code_version().startswith(patchgrid.__version__)


def test_the_model_is_checked_before_any_engine_starts():
    steps.check_model("tiny-llama", SweepConfig(sweeps=("resid",)))
    with pytest.raises(SpecError) as past:  # a given layer past the model's last, named as the command line does
        steps.check_model("tiny-llama", SweepConfig(sweeps=("resid",), layers=(9,)))
    assert past.value.flag_message.startswith("--layers 9: tiny-llama has")
    with pytest.raises(ValueError, match="sweep neurons: .*mixture of experts"):  # a site its family lacks
        steps.check_model("tiny-qwen3-moe", SweepConfig(sweeps=("neurons",)))


@pytest.fixture(scope="module")
def pairs_table(tmp_path_factory):
    """A real pairs table of two relations' records, paired without asking a model, in which some facts
    are marked as the model knowing them alone: an accepted pair's, and one of a fact with no partner."""
    tmp = tmp_path_factory.mktemp("pairs")
    source = tmp / "facts.jsonl"
    records = [line for line in DATA.read_text().splitlines() if json.loads(line)["relation"] in ("plural", "next_day")]
    source.write_text("\n".join(records) + "\n")
    _, _, rows = build_from_source("tiny-llama", str(source), require_known=False)
    accepted = [r["pair_id"] for r in rows if r["status"] == "accepted"]
    alone = [r["pair_id"] for r in rows if r["status"] == "rejected" and r["usable_alone"]]
    assert len(accepted) >= 3 and alone, "the test needs accepted pairs and a fact standing alone"
    known = {accepted[1], alone[0]}
    for r in rows:
        r["known_alone"] = r["pair_id"] in known if r["usable_alone"] else None
    path = tmp / "pairs.parquet"
    write_pairs(rows, path)
    return str(path), known


def test_each_kind_runs_on_its_population_tracing_on_the_facts_known_alone(pairs_table):
    path, known = pairs_table
    table = read_pairs(path)
    chosen = steps.groups(table, SweepConfig(sweeps=("trace", "resid", "heads")), None)
    assert [(g.population, g.names) for g in chosen] == [(POPULATIONS[0], ("resid", "heads")),
                                                          (POPULATIONS[1], ("trace",))]
    pairs, facts = chosen
    assert [p.pair_id for p in pairs.members] == [p.pair_id for p in accepted_pairs(table)]
    order = [r["pair_id"] for r in table.to_pylist()]
    assert [f.pair_id for f in facts.members] == sorted(known, key=order.index)  # a fact with no partner too
    assert steps.first_empty(chosen) is None
    # the limit takes the first N of each population
    assert [len(g.members) for g in steps.groups(table, SweepConfig(sweeps=("resid", "trace")), 1)] == [1, 1]
    # only the kinds that add noise get the run's trace noise
    assert (pairs.noise_std(0.5), facts.noise_std(0.5)) == (0.0, 0.5)


def test_a_population_with_nothing_to_run_on_is_found(pairs_table):
    path, _ = pairs_table
    table = read_pairs(path)
    unjudged = table.set_column(table.schema.get_field_index("known_alone"), "known_alone",
                                pa.nulls(table.num_rows, pa.bool_()))
    chosen = steps.groups(unjudged, SweepConfig(sweeps=("resid", "trace")), None)
    assert chosen[0].members and steps.first_empty(chosen) is chosen[1]


def test_a_kind_over_the_pairs_at_once_gets_one_shard(pairs_table, tmp_path):
    path, _ = pairs_table
    table = read_pairs(path)
    config = SweepConfig(sweeps=("resid", "edges", "circuit", "trace"))
    pairs, facts = steps.groups(table, config, 3)
    shards = steps.shards_of(pairs, "cache-a", 0.0, tmp_path, 1)
    assert len(shards) == 1 and len(shards[0].pairs) == 3  # circuit: one circuit from every pair's edge scores
    assert len(steps.shards_of(steps.groups(table, SweepConfig(sweeps=("resid",)), 3)[0], "cache-a", 0.0, tmp_path,
                               2)) == 2
    traced = steps.shards_of(facts, "cache-b", 0.5, tmp_path, 1, first=len(shards))
    assert [s.index for s in traced] == list(range(1, 1 + len(facts.members)))
    assert all("trace-shard" in s.out and not s.writes_baselines and s.noise_std == 0.5 for s in traced)


def test_what_a_noised_run_records_beside_its_parameters():
    assert steps.measured(None, ("resid",)) == {}
    noise = TraceNoise(0.25, "--trace-noise")
    got = steps.measured(noise, ("resid", "trace"))
    assert got["trace_noise_std"] == 0.25 and got["trace_noise"] == "--trace-noise"
    assert got["traced"].startswith("facts the model knows alone")


def test_a_run_is_recorded_then_loaded(pairs_table, tmp_path):
    path, _ = pairs_table
    wh = str(tmp_path / "w.duckdb")
    steps.start_run_record(wh, "run-steps", "tiny-llama", SHA, {"sweeps": ["resid"]}, steps.now())
    status, params, code = query(wh, "SELECT status, params, code_version FROM runs")[1][0]
    assert status == "running" and json.loads(params) == {"sweeps": ["resid"]}
    assert code == steps.code_version()
    counts = steps.load(wh, "run-steps", path, [], [], finished=steps.now())
    assert counts == {"pairs": read_pairs(path).num_rows, "baselines": 0, "effects": 0}
    assert query(wh, "SELECT status FROM runs")[1] == [("completed",)]
    # a rerun replaces the run's rows, never duplicates them
    steps.load(wh, "run-steps", path, [], [], finished=steps.now(), status="failed")
    assert query(wh, "SELECT count(*), max(status) FROM runs")[1] == [(1, "failed")]
    assert query(wh, "SELECT count(*) FROM pairs")[1][0][0] == counts["pairs"]

