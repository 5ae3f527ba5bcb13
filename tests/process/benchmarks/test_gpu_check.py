"""benchmarks/gpu_check.py, the check for a machine with a GPU, as far as a machine without one can
test it: its dry run on the CPU passes every check and prints them; it runs where vLLM (and the
warehouse and flow packages) cannot be imported; it refuses in one line where no CUDA device is;
and its comparison reports what differs.

The tests that run the script do so in processes of their own, loading models there: no fixture
says so, so they name their tier (engine: as heavy as an engine test)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from patchgrid.methods.attribution import ATP_SITES
from patchgrid.model.sites import SITES
from tests.support.paths import REPO

ROOT = REPO


SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


# what the GPU machine need not have: the engine, and the packages of the warehouse, the flows and Ray
REFUSED = ("vllm", "pyarrow", "duckdb", "prefect", "ray", "datasets", "pandas")


# runs the script as `python benchmarks/gpu_check.py ...` does, as if those packages were not installed:
# None in sys.modules makes `import vllm` (and `vllm.distributed`) raise ModuleNotFoundError and
# importlib.util.find_spec("vllm") answer None, as where vLLM is absent (transformers asks so)
WITHOUT = f"""
import importlib.util, runpy, sys
for name in {REFUSED!r}:
    sys.modules[name] = None
    try:
        __import__(name)
    except ModuleNotFoundError:
        assert importlib.util.find_spec(name) is None
    else:
        raise SystemExit(f"the refusal did not hold: {{name}} imported")
sys.argv = [{str(SCRIPT)!r}] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(*args, refuse: bool = False, timeout: int = 300):
    prefix = ["-c", WITHOUT] if refuse else [str(SCRIPT)]
    return subprocess.run([sys.executable, *prefix, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_the_dry_run_on_the_cpu_passes_every_check_and_prints_the_table_without_vllm():
    # vLLM and the warehouse's packages cannot be imported in this run: the check needs neither
    done = _run("--device", "cpu", "--models", "tiny-llama", refuse=True)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.splitlines()[1].startswith("no GPU used (--device cpu: a dry run); torch ")
    assert "check" in out and "max abs diff" in out and "tolerance" in out
    names = [f"hf tiny-llama: {kind} " for kind in SITES]  # every site kind of the Llama family
    names += [f"attribution tiny-llama: {site} {what} " for site in ATP_SITES for what in ("estimate", "graddrop")]
    for model in ("tiny-llama", "tiny-gpt2"):
        names += [f"worker {model}: planning, site hooks, readout: {part} " for part in ("writes", "captures",
                                                                                          "readout", "unembedding")]
        names.append(f"worker {model}: mid-stack start: writes ")
    rows = {line.split(" (")[0] + " ": line for line in out.splitlines() if " | " in line}
    for name in names:
        assert name in rows, f"no row {name!r} in:\n{out}"
        assert rows[name].rstrip().endswith("pass"), rows[name]
    assert f"{len(rows) - 1} checks, 0 failed" in out


def test_the_worker_part_runs_on_the_meta_device_without_vllm():
    done = _run("--device", "meta", "--worker-models", "tiny-llama", refuse=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(every write on meta) | meta " in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the script runs instead of refusing")
def test_without_a_cuda_device_it_refuses_in_one_line():
    done = _run(timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpu_check: no CUDA device here")
    assert "--device cpu" in done.stderr

