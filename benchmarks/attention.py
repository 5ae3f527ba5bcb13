"""The attention sweeps on vLLM: pattern patching and attention knockout against the plain
head sweep on the same facts, on smollm2-135m, in one process on one engine.

  heads     the heads sweep: each head's clean output (z) patched into the corrupt run, layer x head,
            at every position at once and at the subject's last token and the last token
  pattern   the pattern sweep on the same grid: each head's clean attention pattern patched in, its
            output recomputed from that pattern and the corrupt run's values inside the kernel hook
            (plus one capture run per pair, the clean patterns: its prepare phase, timed with it)
  knockout  the knockout sweep on the same facts' clean prompts: the last position blocked from the
            subject, the other tokens, and itself, over a window of layers around each layer

Each is timed over its own patched runs (calls to the engine, the cache built beforehand, after an
untimed pass of the head sweep warms the engine); the extra cost of the attention kinds is stated per
patched run, against the head sweep's cost per run. A knockout run starts at its window's first layer
(four below the centre with the default window), a head or pattern patch at its own layer: part of a
knockout run's extra cost is those layers, not the recomputed heads.

    .venv/bin/python benchmarks/attention.py [--pairs 4] [--layers 0-29] [--window 9]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(engine, pairs, cache, config) -> tuple[float, int, list]:
    """(seconds, patched runs, rows) of one run_sweeps."""
    from patchgrid.sweeps import count_runs, run_sweeps

    shape = engine.shape
    n = count_runs(pairs, config, shape.n_layers, shape.n_heads, shape.d_mlp, shape.kv_heads)
    t0 = time.perf_counter()
    rows = run_sweeps(engine, pairs, cache, config)
    return time.perf_counter() - t0, n, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pairs", type=int, default=4, help="fact pairs the model knows (default 4)")
    parser.add_argument("--layers", default=None, help="layers of the grids, e.g. 0-29 (default: every layer)")
    parser.add_argument("--window", type=int, default=9, help="knockout: layers blocked around each (default 9)")
    parser.add_argument("--dtype", default=None,
                        help="the model's dtype on vLLM (default: its own, or float32 on a CPU without bf16 units)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from patchgrid.backends.engine import load_engine
    from patchgrid.cache import load_or_build
    from patchgrid.runtime.machine import machine, machine_dtype
    from patchgrid.settings import number_list
    from patchgrid.sweeps import SweepConfig, cache_spec
    from tests.support.pairs import shipped_pairs

    print(machine())
    dtype, why = machine_dtype(args.dtype)
    layers = None if args.layers is None else number_list(args.layers)
    print(f"will run on {args.model} in {dtype} on vLLM ({why}): {args.pairs} shipped fact pairs the model knows; "
          f"the heads, pattern and knockout sweeps (window {args.window}) over "
          f"{'every layer' if layers is None else f'layers {args.layers}'}, each timed alone", flush=True)
    engine = load_engine(args.model, "vllm", dtype=dtype)
    try:
        tok = AutoTokenizer.from_pretrained(engine.folder)
        pairs = shipped_pairs(tok, args.pairs, engine=engine, max_len=engine.shape.max_len)
        configs = {name: SweepConfig(sweeps=(name,), layers=layers, knockout_window=args.window)
                   for name in ("heads", "pattern", "knockout")}
        every = SweepConfig(sweeps=tuple(configs), layers=layers, knockout_window=args.window)
        cache, _ = load_or_build(engine, pairs, cache_spec(every, engine.shape.n_layers), Path(tempfile.mkdtemp()),
                                 log=lambda *_: None)
        # warm-up, untimed: the head sweep over every pair (a first pass over calls of every size and start
        # layer ran at half speed: measured 20 ms a run against 9 once warm, whichever kind went first)
        timed(engine, pairs, cache, configs["heads"])
        got = {name: timed(engine, pairs, cache, config) for name, config in configs.items()}
    finally:
        engine.close()
    base = got["heads"][0] / got["heads"][1]
    print(f"\n{len(pairs)} pairs, model {args.model} ({dtype}), {engine.shape.n_layers} layers x "
          f"{engine.shape.n_heads} heads")
    print(f"{'sweep':<9} {'runs':>6} {'seconds':>8} {'runs/s':>8} {'ms/run':>7} {'extra ms/run vs heads':>22}")
    for name, (seconds, n, _) in got.items():
        per = seconds / n
        extra = "" if name == "heads" else f"{1000 * (per - base):+.2f} ({per / base:.2f}x)"
        print(f"{name:<9} {n:>6} {seconds:>8.1f} {n / seconds:>8.1f} {1000 * per:>7.2f} {extra:>22}")
    knock = [r for r in got["knockout"][2] if r["metric"] == "p"]
    for group in ("subject", "non_subject", "last"):
        rows = [r for r in knock if r["blocked"] == group]
        if rows:
            worst = min(rows, key=lambda r: r["patched_p"] / r["clean_p"] if r["clean_p"] else 0)
            print(f"knockout {group}: lowest p_knocked / p_clean {worst['patched_p'] / worst['clean_p']:.3f} "
                  f"(pair {worst['pair_id']}, layer {worst['layer']})")


if __name__ == "__main__":
    main()
