"""Every setting of a study and what a rerun changing it alone must compute again: the study's four
cached steps and, for each setting, the new value a rerun takes, the steps whose output depends on it
and those that must be found cached. The expectations are written from what each step computes,
independently of the cache keys:
  align_pairs          the pairs table: the data set, the model, how pairs are chosen; written in the run's folder
  measure_trace_noise  the subjects' embedding std: the model, the data set and its format, the scale
  cache_activations    the clean/corrupt/noised captures: the pairs and the sites and runs the sweeps read
  sweep_shard          the effects of a shard; written in the run's folder
A setting that enters the run's recorded parameters gives another run id, so another run folder:
the pairs table and the shards are written anew there. tests/engine/pipeline/test_task_keys.py holds
every setting to these at the level of the tasks' cache keys; tests/flow/flows/test_settings_rerun.py
reruns a few studies to show that Prefect finds (or computes) the steps by those keys.
"""
from __future__ import annotations

from patchgrid.pipeline.spec import run_params
from patchgrid.settings import recorded
from tests.support.pairs import DATA

STEPS = ("align_pairs", "measure_trace_noise", "cache_activations", "sweep_shard")
BASE = dict(model="tiny-llama", pairs=str(DATA), sweeps="resid,trace,atp,paths,edges,circuit,knockout", limit=2,
            require_known=False, trace_samples=2, shard_size=1, backend="hf", atp_kinds="resid", verify_top=2,
            verify_random=1, path_senders="attn_out.1", path_inputs="v", ig_steps=2, circuit_sizes="10,50,100")
# Settings a local rerun cannot change: they need a Ray cluster (tests/flow/flows/test_ray.py runs one).
NEEDS_RAY = {"runner", "ray_address", "tensor_parallel_size", "ray_timeout_s", "ray_workers", "gpus_per_engine"}
# Settings that need a model which knows its facts (the tiny test model knows none): recorded, so a
# change gives another run (checked by tests/unit/pipeline/test_spec.py); the pairs' tests cover what they do.
NEEDS_A_KNOWING_MODEL = {"require_known"}

# setting -> (new value, steps that must be computed again, steps that must be found cached);
# a step in neither may go either way (one of the cache's two populations changes, the other not).
CHANGES = {
    "model": ("tiny-gpt2", set(STEPS), set()),
    "pairs": ("reversed", set(STEPS), set()),
    "limit": (1, {"align_pairs", "cache_activations", "sweep_shard"}, {"measure_trace_noise"}),
    "warehouse": ("other", set(), set(STEPS)),
    "workdir": ("other", {"align_pairs", "cache_activations", "sweep_shard"}, {"measure_trace_noise"}),
    "pairs_format": ("detected", {"align_pairs", "measure_trace_noise", "sweep_shard"}, {"cache_activations"}),
    "answer_policy": ("first-token", {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "trace_noise": (0.5, {"align_pairs", "cache_activations", "sweep_shard"}, {"measure_trace_noise"}),
    "shard_size": (2, {"sweep_shard"}, {"align_pairs", "measure_trace_noise", "cache_activations"}),
    "backend": ("vllm", {"align_pairs", "cache_activations", "sweep_shard"}, {"measure_trace_noise"}),
    "dtype": ("float32", {"align_pairs", "cache_activations", "sweep_shard"}, {"measure_trace_noise"}),
    "run_id": ("run-by-hand", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "gpu_memory_utilization": (0.5, set(), set(STEPS)),
    "max_num_seqs": (64, set(), set(STEPS)),
    "max_num_batched_tokens": (4096, set(), set(STEPS)),
    "atp_device": ("cpu", {"sweep_shard"}, {"align_pairs", "measure_trace_noise", "cache_activations"}),
    "atp_dtype": ("bfloat16", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "name": ("a label", set(), set(STEPS)),
    "config": ('limit = 2\nsweeps = "resid,trace,atp,paths,edges,circuit,knockout"\n'
               'circuit_sizes = "10,50,100"\n', set(),
               set(STEPS)),
    "sweeps": ("trace,atp,paths,edges,circuit,knockout", {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "resid_directions": (("denoise",), {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "head_position_roles": (("last",), {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "head_positions": ("every", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "trace_samples": (3, {"align_pairs", "cache_activations", "sweep_shard"}, {"measure_trace_noise"}),
    "trace_window": (2, {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "trace_noise_scale": (2.0, set(STEPS), set()),
    "trace_sites": (("resid",), {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "trace_facts": ("rome", {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "seed": (1, {"align_pairs", "cache_activations", "sweep_shard"}, {"measure_trace_noise"}),
    "max_requests": (7, {"sweep_shard"}, {"align_pairs", "measure_trace_noise", "cache_activations"}),
    "positions": ((0, 2), {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "layers": ("0,2-3", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "start_midstack": (False, {"align_pairs", "cache_activations", "sweep_shard"}, {"measure_trace_noise"}),
    "metrics": ("logit_diff,kl", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "atp_kinds": ("resid,attn_out,heads", {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "verify_top": (3, {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "verify_random": (0, {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "atp_qk_fix": (False, {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "atp_correction": ("graddrop", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "path_senders": ("attn_out.0", {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "path_receivers": ("heads", {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "path_inputs": ("q", {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "path_mlps": ("recomputed", {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
    "edge_method": ("eap", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "ig_steps": (3, {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "edge_positions": ("each", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "circuit_sizes": ("1,100", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "circuit_build": ("greedy", {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    "knockout_window": (3, {"align_pairs", "sweep_shard"}, {"measure_trace_noise", "cache_activations"}),
    # mean: the circuit's outside edges read the clean runs' senders, not the corrupt runs'
    "ablation": ("mean", {"align_pairs", "sweep_shard"}, {"measure_trace_noise"}),
}


def changed_value(name, value, tmp_path):
    """The value `name` takes in a rerun, made real where it names a file or folder (under `tmp_path`)."""
    if name == "pairs":  # the same records in another order: other pairs
        other = tmp_path / "reversed.jsonl"
        other.write_text("".join(reversed(DATA.read_text().splitlines(keepends=True))))
        return str(other)
    if name in ("warehouse", "workdir"):
        return str(tmp_path / f"other-{name}")
    if name == "pairs_format":
        from patchgrid.pairs import read_source

        return read_source(str(DATA))[0]
    return value


# The settings that leave every step cached (the run's labels and the engines' sizes, recorded but out
# of the run id) are changed together in one case: several changes keep a step cached only if each
# change alone does. (The warehouse, also all cached, moves the run elsewhere: a case of its own.)
TOGETHER = sorted(n for n, (_, recomputed, cached) in CHANGES.items()
                  if not recomputed and cached == set(STEPS) and n != "warehouse")
CASES = [n for n in sorted(CHANGES) if n not in TOGETHER] + ["+".join(TOGETHER)]


def expected(case: str) -> tuple[set[str], set[str]]:
    """(steps a rerun of `case` must compute again, steps it must find cached)."""
    names = case.split("+")
    return set().union(*(CHANGES[n][1] for n in names)), set.intersection(*(CHANGES[n][2] for n in names))


def rerun_spec(spec, case: str, tmp_path):
    """`spec` with the settings of `case` changed."""
    return spec.replace(**{n: changed_value(n, CHANGES[n][0], tmp_path) for n in case.split("+")})


def identity_params(spec) -> dict:
    """What a study's default run id is derived from (StudySpec.default_run_id, pipeline.spec.default_run_id's
    rule): its recorded parameters but the `noted` ones."""
    return run_params(recorded(spec, set(), noted=False), spec.sweep, noted=False)
