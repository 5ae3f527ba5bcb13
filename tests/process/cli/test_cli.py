"""A command on vLLM as a researcher runs it, a process of its own, against the same command on the Hugging
Face backend (the other commands, and their refusals once the model has loaded, run in process:
tests/engine/cli/)."""
from __future__ import annotations

import json
import subprocess
import sys

from patchgrid.metrics import METRICS
from tests.support.engines import needs_vllm

PAIR = ["--clean", "The capital of France is", "--corrupt", "The capital of Spain is",
        "--clean-answer", " Paris", "--corrupt-answer", " Madrid"]


def run_clis(*commands, timeout=300):
    """Commands independent of one another (each a tuple of arguments), run at once, each in a process
    of its own, as a researcher runs one: their results, in order. (Their seconds of imports and engine starts
    overlap.)"""
    procs = [subprocess.Popen([sys.executable, "-m", "patchgrid", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@needs_vllm
def test_patch_json_on_vllm_matches_hf():
    args = ["patch", "--model", "tiny-llama", *PAIR, "--site", "resid", "--json"]
    out_v, out_h = run_clis((*args, "--backend", "vllm"), (*args, "--backend", "hf"))
    assert out_v.returncode == 0, out_v.stderr
    assert out_h.returncode == 0, out_h.stderr
    v, h = json.loads(out_v.stdout), json.loads(out_h.stdout)
    assert set(v) == {"baseline", "effects"}
    assert set(v["baseline"]) == {"metric", "clean", "corrupt", "runs"} and v["baseline"]["metric"] == "logit_diff"
    n_tokens = len({e["position"] for e in v["effects"]})
    assert len(v["effects"]) == 4 * n_tokens  # every layer x every position
    e = v["effects"][0]
    assert set(e) == {"site", "layer", "position", "head", "neuron", "recovery", *METRICS}
    assert e["head"] is None and e["neuron"] is None and e["site"] == "resid"
    for a, b in zip(v["effects"], h["effects"]):
        assert (a["layer"], a["position"]) == (b["layer"], b["position"])
        for m in METRICS:
            assert abs(a[m] - b[m]) < 1e-4, m
