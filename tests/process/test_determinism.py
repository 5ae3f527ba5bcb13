"""Same inputs and seed give bit-identical effects across runs and engines, causal-tracing noise included."""
from __future__ import annotations

import tempfile
from pathlib import Path

from patchgrid.backends.engine import load_engine
from patchgrid.cache import load_or_build
from patchgrid.sweeps import SweepConfig, cache_spec, run_sweeps
from tests.support.engines import needs_vllm
from tests.support.pairs import noise_std_for, shipped_pairs

CFG = SweepConfig(sweeps=("resid", "heads", "trace"), trace_samples=3, seed=7)


@needs_vllm
def test_two_engines_give_bit_identical_effects(tokenizers):
    pairs = shipped_pairs(tokenizers("tiny-qwen3"), 3)
    runs = []
    for _ in range(2):
        engine = load_engine("tiny-qwen3", "vllm")  # a fresh engine each time
        cache, _ = load_or_build(engine, pairs, cache_spec(CFG, 4, noise_std_for(engine, pairs)),
                                 Path(tempfile.mkdtemp()), log=lambda *_: None)
        runs.append(run_sweeps(engine, pairs, cache, CFG))
        engine.close()
    assert runs[0] == runs[1]
    assert any(r["sweep"] == "trace" for r in runs[0])
