"""The study specification: one validated value, the flow's parameters exactly its fields."""
from __future__ import annotations

import inspect

import pytest

from patchgrid.fingerprint import fingerprint
from patchgrid.spec import ShardSpec, SpecError, StudySpec
from patchgrid.sweeps import SweepConfig


def test_the_flow_takes_exactly_the_spec_fields_with_its_defaults():
    from patchgrid.flows.study import study

    params = inspect.signature(study.fn).parameters
    default = StudySpec()
    assert list(params) == list(StudySpec.__dataclass_fields__)
    for name, p in params.items():
        want = getattr(default, name)
        want = ",".join(want) if isinstance(want, tuple) else want
        assert p.default == want, name
    assert StudySpec(**StudySpec(limit=3).flow_parameters()) == StudySpec(limit=3)


@pytest.mark.parametrize("change, flow_message, flag_message", [
    ({"limit": 0}, "limit 0 must be at least 1", "--limit 0 must be at least 1"),
    ({"path_senders": "head.1"}, "path sender 'head.1'", "path sender 'head.1'"),
    ({"path_receivers": "attn_out.2"}, "path receiver 'attn_out.2'", "path receiver 'attn_out.2'"),
    ({"path_inputs": "q,z"}, "path input 'z'", "path input 'z'"),
    ({"path_mlps": "half"}, "path_mlps 'half'", "path_mlps 'half'"),
    ({"trace_samples": 0}, "trace_samples 0 must be at least 1", "--trace-samples 0 must be at least 1"),
    ({"sweeps": "resid,bogus"}, "unknown sweep 'bogus'", "unknown sweep 'bogus'"),
    ({"backend": "tpu"}, "backend 'tpu' is not one of", "--backend 'tpu' is not one of"),
    ({"tensor_parallel_size": 2}, "runs in Ray engine actors", "--tensor-parallel-size > 1"),
    ({"run_id": "a b"}, "run_id 'a b' may hold only", "--run-id 'a b' may hold only"),
    ({"answer_policy": "whole"}, "answer_policy 'whole' is not one of single, full, first-token",
     "--answer-policy 'whole' is not one of"),
    ({"verify_top": -1}, "verify_top -1 must not be negative", "--verify-top -1 must not be negative"),
    ({"atp_kinds": "heads,trace"}, "unknown atp kind 'trace'", "unknown atp kind 'trace'"),
    ({"atp_correction": "qk"}, "unknown atp correction 'qk'", "unknown atp correction 'qk'"),
])
def test_bad_parameters_are_named(change, flow_message, flag_message):
    with pytest.raises(SpecError) as err:
        StudySpec(**change)
    assert flow_message in str(err.value) and flag_message in err.value.flag_message


def test_answer_policy_is_recorded_and_keys_the_run():
    full, single = StudySpec(), StudySpec(answer_policy="single")
    assert full.answer_policy == "full" and full.recorded_params()["answer_policy"] == "full"
    assert fingerprint(full.recorded_params()) != fingerprint(single.recorded_params())


def test_sweeps_are_normalised_and_frozen():
    spec = StudySpec(sweeps=" resid, trace ")
    assert spec.sweeps == ("resid", "trace")
    with pytest.raises(AttributeError):
        spec.limit = 3  # frozen


def test_outputs_count_by_path_inputs_by_content(tmp_path):
    """A shard's output file changes when it is written; its key must not."""
    out = tmp_path / "shard.parquet"
    shard = ShardSpec(0, (), str(tmp_path), SweepConfig(), 0.0, str(out))
    before = fingerprint(shard)
    out.write_text("written")
    assert fingerprint(shard) == before
    data = tmp_path / "facts.jsonl"
    data.write_text("a")
    spec = StudySpec(pairs=str(data))
    key = fingerprint(spec)
    data.write_text("b")  # the same path, other content: another input
    assert fingerprint(spec) != key


def test_atp_settings_key_the_run_only_when_the_atp_sweep_runs():
    plain = StudySpec()
    assert "verify_top" not in plain.recorded_params()
    assert fingerprint(plain.recorded_params()) == fingerprint(StudySpec(verify_top=5).recorded_params())
    atp = StudySpec(sweeps="atp", verify_top=5)
    assert atp.recorded_params()["verify_top"] == 5 and atp.sweep_config().verify_top == 5
    assert fingerprint(atp.recorded_params()) != fingerprint(StudySpec(sweeps="atp").recorded_params())
