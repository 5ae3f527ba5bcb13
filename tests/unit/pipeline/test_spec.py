"""The study specification: one validated value, the flow's parameters exactly its fields."""
from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from patchgrid.pipeline.fingerprint import fingerprint
from patchgrid.pipeline.spec import ShardSpec, SpecError, StudySpec
from patchgrid.sweeps import SweepConfig
from tests.support.reruns import identity_params


def test_the_flow_takes_the_spec_as_its_one_typed_parameter():
    from patchgrid.flows.study import study

    params = inspect.signature(study.fn).parameters
    assert list(params) == ["spec"] and params["spec"].annotation in (StudySpec, "StudySpec")
    assert params["spec"].default == StudySpec()
    # as Prefect validates a deployment's JSON parameters: nested settings, lists for lists
    spec = StudySpec.of(limit=3, sweeps="resid,atp", verify_top=4)
    as_json = json.loads(json.dumps(dataclasses.asdict(spec)))
    assert study.validate_parameters({"spec": as_json})["spec"] == spec


@pytest.mark.parametrize("change, flow_message, flag_message", [
    ({"limit": 0}, "limit 0 must be at least 1", "--limit 0 must be at least 1"),
    ({"path_senders": "head.1"}, "path sender 'head.1'", "path sender 'head.1'"),
    ({"path_receivers": "attn_out.2"}, "path receiver 'attn_out.2'", "path receiver 'attn_out.2'"),
    ({"path_inputs": "q,z"}, "path input 'z'", "path input 'z'"),
    ({"path_mlps": "half"}, "path_mlps 'half' is not one of", "--path-mlps 'half' is not one of"),
    ({"trace_samples": 0}, "trace_samples 0 must be at least 1", "--trace-samples 0 must be at least 1"),
    ({"sweeps": "resid,bogus"}, "unknown sweep 'bogus'", "unknown sweep 'bogus'"),
    ({"backend": "tpu"}, "backend 'tpu' is not one of", "--backend 'tpu' is not one of"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size applies only with --runner ray (the runner is local)",
     "--tensor-parallel-size applies only with --runner ray"),
    ({"ray_workers": 9}, "ray_workers applies only with --runner ray", "--ray-workers applies only with --runner ray"),
    ({"gpus_per_engine": 1.0}, "gpus_per_engine applies only", "--gpus-per-engine applies only with --runner ray"),
    ({"ray_address": "head:6379"}, "ray_address applies only", "--ray-address applies only with --runner ray"),
    ({"ray_timeout_s": 5.0}, "ray_timeout_s applies only", "--ray-timeout-s applies only with --runner ray"),
    ({"sweeps": "resid", "path_senders": "head.1.1"}, "path_senders applies only to the paths sweep (--sweeps resid)",
     "--path-senders applies only to the paths sweep (--sweeps resid)"),
    ({"sweeps": "resid,heads", "verify_top": 5}, "verify_top applies only to the atp and edges sweeps",
     "--verify-top applies only to the atp and edges sweeps (--sweeps resid,heads)"),
    ({"run_id": "a b"}, "run_id 'a b' may hold only", "--run-id 'a b' may hold only"),
    ({"answer_policy": "whole"}, "answer_policy 'whole' is not one of single, full, first-token",
     "--answer-policy 'whole' is not one of"),
    ({"verify_top": -1}, "verify_top -1 must not be negative", "--verify-top -1 must not be negative"),
    ({"atp_kinds": "heads,trace"}, "unknown atp kind 'trace'", "unknown atp kind 'trace'"),
    ({"atp_correction": "qk"}, "atp_correction 'qk' is not one of", "--atp-correction 'qk' is not one of"),
    ({"pairs_format": "csv"}, "pairs_format 'csv' is not one of", "--format 'csv' is not one of"),
    ({"colour": "red"}, "unknown setting 'colour'", "unknown setting 'colour'"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization 0.0 must be above 0 and at most 1",
     "--gpu-memory-utilization 0.0 must be above 0"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization 1.5 must be above 0 and at most 1",
     "--gpu-memory-utilization 1.5"),
    ({"max_num_seqs": 0}, "max_num_seqs 0 must be at least 1", "--max-num-seqs 0 must be at least 1"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens 0 must be at least 1", "--max-num-batched-tokens 0"),
    ({"atp_device": "gpu"}, "atp_device 'gpu' is not a device: use cpu, cuda or cuda:N", "--atp-device 'gpu'"),
    ({"atp_dtype": "int8"}, "atp_dtype 'int8' is not one of float32, bfloat16, float16", "--atp-dtype 'int8'"),
])
def test_bad_parameters_are_named(change, flow_message, flag_message):
    with pytest.raises(SpecError) as err:
        StudySpec.of(**change)
    assert flow_message in str(err.value) and flag_message in err.value.flag_message


def test_answer_policy_is_recorded_and_keys_the_run():
    full, single = StudySpec(), StudySpec.of(answer_policy="single")
    assert full.answer_policy == "full" and full.recorded_params()["answer_policy"] == "full"
    assert fingerprint(full.recorded_params()) != fingerprint(single.recorded_params())


def test_sweeps_are_normalised_and_frozen():
    spec = StudySpec.of(sweeps=" resid, trace ")
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
    spec = StudySpec.of(pairs=str(data))
    key = fingerprint(spec)
    data.write_text("b")  # the same path, other content: another input
    assert fingerprint(spec) != key


def test_atp_settings_key_the_run_only_when_the_atp_sweep_runs():
    plain = StudySpec()
    assert "verify_top" not in plain.recorded_params()
    assert fingerprint(plain.recorded_params()) == fingerprint(StudySpec.of(verify_top=20).recorded_params())
    # a value that would change nothing
    with pytest.raises(SpecError, match="verify_top applies only to the atp and edges sweeps"):
        StudySpec.of(verify_top=5)
    atp = StudySpec.of(sweeps="atp", verify_top=5)
    assert atp.recorded_params()["verify_top"] == 5 and atp.sweep.verify_top == 5
    assert fingerprint(atp.recorded_params()) != fingerprint(StudySpec.of(sweeps="atp").recorded_params())


def _every_setting():
    from patchgrid.settings import settings_fields

    return [(cls, f) for cls in (StudySpec, SweepConfig) for f in settings_fields(cls)]


def test_every_field_is_a_declared_setting():
    """One declaration per setting: every field of the spec and the sweep config carries its help,
    its check and its record rule (the nested sweep config aside)."""
    from patchgrid.settings import RECORDS

    names = [f.name for _, f in _every_setting()]
    assert len(names) == len(set(names)), "a setting declared twice"
    assert set(names) | {"sweep"} == {f.name for f in dataclasses.fields(StudySpec)} | \
        {f.name for f in dataclasses.fields(SweepConfig)}
    for _, f in _every_setting():
        assert f.metadata["help"] and f.metadata["record"] in RECORDS, f.name


@pytest.mark.parametrize("command", ["study", "serve", "sweep"])
def test_the_command_options_are_generated_from_the_settings(command):
    """study, serve and sweep offer every command-line setting they take, under one flag each, with
    the declared default and help; parsing a command line gives the declared types."""
    from patchgrid.cli import build_parser
    from patchgrid.cli.options import settings_from
    from patchgrid.settings import flag_of

    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    actions = {a.dest: a for a in sub._actions}
    takes = [(cls, f) for cls, f in _every_setting() if f.metadata["cli"] and
             (cls is SweepConfig or command != "sweep" or f.name in ("model", "limit", "backend", "dtype"))]
    for _cls, f in takes:
        assert f.name in actions, f"{command} lacks {flag_of(f)}"
        assert flag_of(f) in actions[f.name].option_strings
        assert f.metadata["help"] in actions[f.name].help
    extra = ["--cron", "0 3 * * *"] if command == "serve" else []
    pairs = ["--pairs-table", "p.parquet"] if command == "sweep" else []
    args = parser.parse_args([command, *pairs, *extra, "--sweeps", "resid,atp", "--verify-top", "3",
                              "--no-start-midstack", "--max-requests", "64"])
    config = SweepConfig(**settings_from(args, SweepConfig))
    assert config == SweepConfig(sweeps=("resid", "atp"), verify_top=3, start_midstack=False, max_requests=64)
    if command != "sweep":
        spec = StudySpec.of(**settings_from(args, StudySpec), **settings_from(args, SweepConfig))
        assert spec.sweep == config and spec.require_known is True


def test_help_shows_every_default(capsys):
    from patchgrid.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["study", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("(default: 2048)", "(default: resid,attn_out,mlp_out,heads)", "(default: True)",
                   "--no-start-midstack", "(default: 8)", "--max-requests"):
        assert needle in text, needle


def test_recorded_parameters_follow_each_settings_declaration():
    """always: a change changes the run id; never: it does not; if_used: only when a sweep of the
    run reads it; if_changed: absent at its default."""
    from patchgrid.sweeps import settings_of

    base = StudySpec.of(sweeps="resid,atp,paths")
    for _cls, f in _every_setting():
        rule = f.metadata["record"]
        present = f.name in base.recorded_params()
        used = f.name in settings_of(base.sweeps)
        assert present == (rule in ("always", "noted") or (rule == "if_used" and used)), f.name
        assert (f.name in identity_params(base)) == (present and rule != "noted"), f.name
    assert "trace_window" in StudySpec.of(sweeps="resid,trace", trace_window=4).recorded_params()
    assert fingerprint(StudySpec.of(shard_size=3).recorded_params()) == fingerprint(StudySpec().recorded_params())
    assert fingerprint(StudySpec.of(seed=3).recorded_params()) != fingerprint(StudySpec().recorded_params())


ENGINE_SIZES = {"gpu_memory_utilization": 0.5, "max_num_seqs": 64, "max_num_batched_tokens": 4096}


@pytest.mark.parametrize("name, value", [*ENGINE_SIZES.items(), ("atp_device", "cpu")])
def test_noted_settings_are_recorded_but_leave_the_run_id(name, value):
    """How engines are sized and where the gradients run leave the numbers alone: recorded, with
    their defaults too, but the run's identity (its default run id) is the same."""
    base, changed = StudySpec.of(sweeps="resid,atp"), StudySpec.of(sweeps="resid,atp", **{name: value})
    assert base.recorded_params()[name] is None and changed.recorded_params()[name] == value
    assert name not in identity_params(changed)
    assert fingerprint(identity_params(changed)) == fingerprint(identity_params(base))
    assert fingerprint(changed.recorded_params()) != fingerprint(base.recorded_params())


def test_the_gradient_dtype_keys_the_run_when_changed():
    """Half precision changes the estimates: a bfloat16 run is another run; float32 (the default)
    leaves every earlier run id as it was."""
    plain = StudySpec.of(sweeps="resid,atp")
    assert "atp_dtype" not in identity_params(plain)
    half = plain.replace(atp_dtype="bfloat16")
    assert identity_params(half)["atp_dtype"] == "bfloat16"
    assert fingerprint(identity_params(half)) != fingerprint(identity_params(plain))
    assert half.attribution_options() == {"device": None, "dtype": "bfloat16"}
    assert StudySpec.of(sweeps="resid,atp", atp_device="cuda:1").attribution_options() == {"device": "cuda:1",
                                                                                          "dtype": "float32"}


@pytest.mark.parametrize("command", ["study", "serve", "sweep"])
def test_the_engines_dtype_is_a_setting_that_keys_the_run_when_changed(command):
    """--dtype on every command that starts engines for a run: recorded, in the run id when not auto (auto, the
    default, leaves every earlier run id as it was), and handed to every engine of the run, on either backend."""
    from patchgrid.cli import build_parser
    from patchgrid.cli.options import settings_from

    extra = {"serve": ["--cron", "0 3 * * *"], "sweep": ["--pairs-table", "p.parquet"]}.get(command, [])
    args = build_parser().parse_args([command, *extra, "--dtype", "float32"])
    assert args.dtype == "float32"
    if command == "sweep":
        return  # its own run id: tests/engine/cli/test_model_commands.py
    spec = StudySpec.of(**settings_from(args, StudySpec))
    plain = spec.replace(dtype="auto")
    assert "dtype" not in identity_params(plain) and identity_params(spec)["dtype"] == "float32"
    assert fingerprint(identity_params(spec)) != fingerprint(identity_params(plain))
    assert spec.recorded_params()["dtype"] == "float32"
    assert spec.engine_options() == {"dtype": "float32"} and plain.engine_options() == {}
    assert spec.replace(backend="hf").engine_options() == {"dtype": "float32"}
    assert spec.engine_identity() == {"model": spec.model, "backend": spec.backend, "dtype": "float32"}
    with pytest.raises(SpecError, match="dtype 'int8' is not one of"):
        StudySpec.of(dtype="int8")


def test_engine_options_are_the_sizes_set_for_the_backend_that_takes_them():
    assert StudySpec().engine_options() == {}  # the device's defaults (patchgrid.backends.vllm)
    sized = StudySpec.of(**ENGINE_SIZES, runner="ray", tensor_parallel_size=2)
    assert sized.engine_options() == {**ENGINE_SIZES, "tensor_parallel_size": 2}
    assert StudySpec.of(max_num_seqs=8).engine_options() == {"max_num_seqs": 8}
    assert sized.replace(backend="hf").engine_options() == {"tensor_parallel_size": 2}


def test_engine_sizes_left_unset_suit_the_device():
    """vLLM's own defaults on a GPU (nothing passed); on CPU the fraction and batch that start there."""
    from patchgrid.backends.vllm import CPU_SIZES, engine_sizes

    unset = dict.fromkeys(ENGINE_SIZES)
    assert engine_sizes(unset, on_cpu=False) == {}
    assert engine_sizes(unset, on_cpu=True) == CPU_SIZES == {"gpu_memory_utilization": 0.3, "max_num_seqs": 1024,
                                                             "max_num_batched_tokens": 16384}
    assert engine_sizes(ENGINE_SIZES, on_cpu=True) == engine_sizes(ENGINE_SIZES, on_cpu=False) == ENGINE_SIZES


def test_a_shard_carries_its_gradient_options_into_its_key(tmp_path):
    shard = ShardSpec(0, (), str(tmp_path), SweepConfig(), 0.0, str(tmp_path / "s.parquet"))
    assert shard.attribution == {}
    options = StudySpec.of(sweeps="atp", atp_dtype="bfloat16").attribution_options()
    half = dataclasses.replace(shard, attribution=options)
    assert fingerprint(half) != fingerprint(shard)


def test_a_warehouse_in_a_missing_folder_is_checked_unmade_and_made_by_its_first_write(tmp_path):
    """check_inputs leaves a warehouse that is not there yet unmade (a study refused later leaves no
    file); its folder, missing, is made by the first write, not refused; a folder that is a file is."""
    from patchgrid.warehouse.loader import ensure

    wh = tmp_path / "results" / "deep" / "w.duckdb"
    spec = StudySpec.of(warehouse=str(wh))
    spec.check_inputs()
    assert list(tmp_path.iterdir()) == []
    ensure(spec.warehouse)
    assert wh.is_file() and (tmp_path / "results" / "deep" / "w.data").is_dir()
    (tmp_path / "plain").write_text("")
    with pytest.raises(ValueError, match=f"{tmp_path / 'plain'} is a file, not a folder"):
        StudySpec.of(warehouse=str(tmp_path / "plain" / "sub" / "w.duckdb")).check_inputs()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "results"]
