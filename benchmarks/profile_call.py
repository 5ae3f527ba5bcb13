"""Where a patched run's time goes: one sweep call profiled with Python's own profiler (cProfile) and
its time split into vLLM's scheduling, vLLM's model runner, the model's forward, patchgrid's step
planning, patchgrid's hooks, patchgrid's readout and the sweep code around the engine; beside it the
same tokens as a plain vLLM prefill, split the same way.

On a model whose matrix work is negligible (tiny-llama, the default) what is left is the per-request
work that decides the speed on a GPU with a large model.

How the split is made: cProfile records, per function, the time spent in its own code and, per
caller, how much of that came from each caller. Each function's own time goes to the part its file
belongs to (PARTS below); the own time of a function in no part (torch's Python modules, the
standard library, torch's C functions such as a matmul or a copy) goes to its callers, in the
shares cProfile measured per caller, up to the nearest function in a part. So a tensor operation a
hook performs counts as the hook's, and a layer's matmul as the model's. Above the first level
of callers the shares are the callers' shares of the function's whole time, an approximation where
one function is called from several parts. The profiler adds a cost to every Python call, so
parts made of many small Python calls read larger under it than they are: the unprofiled times are
printed too.

With --started, the sweep as a study runs it (each patched run started mid-stack) is profiled too,
first, split the same way.

    .venv/bin/python benchmarks/profile_call.py [--model tiny-llama] [--pairs 16] [--top 12] [--started]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (part, path fragments of the files whose own time is that part's), the first match wins
PARTS = (
    # vLLM's C kernels for the RMS norms, which the worker puts in vLLM's forward on a CPU: vLLM's work
    ("model forward", ("patchgrid/backends/vllm_worker/kernels.py",)),
    ("patchgrid hooks", ("patchgrid/backends/vllm_worker/hooks.py", "patchgrid/backends/vllm_worker/midstack.py")),
    ("patchgrid readout", ("patchgrid/backends/vllm_worker/readout.py", "patchgrid/backends/unembed.py",
                           "patchgrid/metrics.py")),
    # the engine interface and its pool (backends/engine.py) call the sweeps' engine work: sweep code
    ("patchgrid sweep code", ("patchgrid/backends/engine.py", "patchgrid/backends/cluster.py")),
    ("patchgrid step planning", ("patchgrid/backends/", "patchgrid/plan/")),
    ("patchgrid sweep code", ("patchgrid/",)),
    ("model forward", ("vllm/model_executor/", "vllm/attention/", "vllm/v1/attention/", "vllm/_custom_ops.py",
                       "vllm/forward_context.py", "vllm/distributed/", "vllm/compilation/", "vllm/ir/")),
    ("vLLM model runner", ("vllm/v1/worker/", "vllm/v1/sample/", "vllm/v1/executor/")),
    ("vLLM scheduling", ("vllm/",)),
)
UNPLACED = "not placed (no caller in a part)"


def part_of(filename: str) -> str | None:
    path = filename.replace("\\", "/")
    if "/site-packages/" in path and "/vllm/" not in path:
        return None  # torch, transformers, numpy...: placed by their callers
    for part, fragments in PARTS:
        if any(f in path for f in fragments):
            return part
    return None


def _mix(raw, weights: dict, memo: dict, seen: tuple) -> dict[str, float]:
    """How a second divides among the parts when it came from the callers in `weights` in those shares."""
    total = sum(weights.values())
    if not total:
        return {UNPLACED: 1.0}
    out: dict[str, float] = defaultdict(float)
    for caller, w in weights.items():
        for p, s in _shares(raw, caller, memo, seen).items():
            out[p] += s * w / total
    return dict(out)


def _shares(raw, func, memo: dict, seen: tuple = ()) -> dict[str, float]:
    """How a second of `func`'s time divides among the parts: its own part, else through its callers
    in the shares of its whole time each caused."""
    part = part_of(func[0])
    if part is not None:
        return {part: 1.0}
    if func not in memo:
        callers = raw[func][4] if func in raw else {}
        memo[func] = _mix(raw, {c: w[3] or w[2] for c, w in callers.items() if c not in seen and c != func},
                          memo, seen + (func,))
    return memo[func]


def split(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own time per part, the unplaced own time carried to its callers (module docstring)."""
    raw = stats.stats  # func -> (primitive calls, calls, own time, cumulative time, {caller: (.., .., own, cum)})
    totals: dict[str, float] = defaultdict(float)
    memo: dict = {}
    for func, (_, _, own, _, callers) in raw.items():
        part = part_of(func[0])
        if part is not None:
            totals[part] += own
            continue
        # the first level exactly: the own time each caller caused
        caused = {c: w[2] for c, w in callers.items() if c != func}
        shares = _mix(raw, caused, memo, (func,)) if sum(caused.values()) else _shares(raw, func, memo)
        for p, s in shares.items():
            totals[p] += own * s
    return dict(totals)


def profiled(fn):
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        fn()
    finally:
        prof.disable()
    return time.perf_counter() - t0, pstats.Stats(prof)


def report(name: str, runs: int, plain_s: float, prof_s: float, stats: pstats.Stats, top: int) -> None:
    parts = split(stats)
    total = sum(parts.values())
    print(f"{name}: {runs} runs, {plain_s:.2f} s unprofiled ({runs / plain_s:.1f} runs/s), {prof_s:.2f} s profiled")
    order = list(dict.fromkeys(p for p, _ in PARTS)) + [UNPLACED]  # a part named twice in PARTS printed once
    for part in order:
        if parts.get(part, 0) > 0:
            t = parts[part]
            print(f"  {part:<34} {t:7.2f} s  {100 * t / total:5.1f}%  {1e6 * t / runs:8.1f} us per run")
    if top:
        print(f"  the {top} functions with the most own time:")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
        for (file, line, func), (_, calls, own, _, _) in rows:
            where = file.split("site-packages/")[-1].replace(str(Path(__file__).resolve().parents[1]) + "/", "")
            print(f"    {own:6.2f} s  {calls:8d} calls  {func} ({where}:{line})  [{part_of(file) or 'by callers'}]")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--sweeps", default="resid,attn_out,mlp_out,heads")
    parser.add_argument("--max-requests", type=int, default=2048)
    parser.add_argument("--top", type=int, default=12, help="functions listed by own time (0: none)")
    parser.add_argument("--started", action="store_true",
                        help="also profile the sweep with each patched run started mid-stack (as a study runs it)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from benchmarks.sweep_throughput import full_run_tokens, plain_prefill
    from patchgrid.backends.engine import load_engine
    from patchgrid.cache import load_or_build
    from patchgrid.runtime.machine import machine
    from patchgrid.sweeps import SweepConfig, cache_spec, count_runs, run_sweeps
    from tests.support.pairs import shipped_pairs

    print(machine())
    engine = load_engine(args.model, "vllm")
    tok = AutoTokenizer.from_pretrained(engine.folder)
    pairs = shipped_pairs(tok, args.pairs, engine=engine, max_len=engine.shape.max_len)[:args.pairs]
    shape = engine.shape
    config = SweepConfig(sweeps=tuple(args.sweeps.split(",")), max_requests=args.max_requests)
    runs = count_runs(pairs, config, shape.n_layers, shape.n_heads)
    print(f"model {args.model} ({str(engine.dtype).removeprefix('torch.')}), {shape.n_layers} layers; "
          f"{len(pairs)} pairs, sweeps {args.sweeps}: {runs} patched runs; the profile is of the whole sweep "
          f"call{', started mid-stack, then' if args.started else ','} every layer computed, then of the same "
          "tokens as a plain vLLM prefill")
    cache, _ = load_or_build(engine, pairs, cache_spec(config, shape.n_layers, 0.0), Path(tempfile.mkdtemp()),
                             log=lambda *_: None)
    full = replace(config, start_midstack=False)
    tokens = full_run_tokens(engine, pairs, config, 0.0)

    def sweep():
        run_sweeps(engine, pairs, cache, full, noise_std=0.0)

    def started():
        run_sweeps(engine, pairs, cache, config, noise_std=0.0)

    def prefill():
        plain_prefill(engine, tokens, args.max_requests)

    run_sweeps(engine, pairs[:1], cache, full, noise_std=0.0)  # warm-up: the first calls pay one-off costs
    ways = [("patchgrid, every layer", sweep, runs), ("plain vLLM prefill", prefill, len(tokens))]
    if args.started:
        run_sweeps(engine, pairs[:1], cache, config, noise_std=0.0)
        ways.insert(0, ("patchgrid, started mid-stack", started, runs))
    prefill()
    for name, fn, n in ways:
        t0 = time.perf_counter()
        fn()
        plain_s = time.perf_counter() - t0
        prof_s, stats = profiled(fn)
        report(name, n, plain_s, prof_s, stats, args.top)
    engine.close()


if __name__ == "__main__":
    main()
