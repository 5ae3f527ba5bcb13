"""Pairs per minute for the default sweep set on smollm2-135m, and the intervention overhead.

In one process, on the same pairs and the same activation cache:
  engine    patchgrid's sweeps on the vLLM backend
  hf-batch  the same sweeps on the Hugging Face reference, patched runs batched per forward
  plain     vLLM prefill of exactly the same token lists with no intervention at all

Prints pairs per minute for engine and hf-batch and their ratio, and the intervention overhead
= engine sweep time / plain prefill time (target <= 1.25).

    .venv/bin/python benchmarks/sweep_throughput.py [--pairs 4] [--sweeps resid,attn_out,mlp_out,heads]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--sweeps", default="resid,attn_out,mlp_out,heads")
    parser.add_argument("--max-requests", type=int, default=2048)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from patchgrid.cache import load_or_build
    from patchgrid.engine import load_engine
    from patchgrid.sweeps import SweepConfig, SweepContext, cache_spec, count_runs, patched_runs, run_sweeps
    from tests.study_helpers import shipped_pairs

    engine = load_engine(args.model, "vllm")
    tok = AutoTokenizer.from_pretrained(engine.folder)
    pairs = shipped_pairs(tok, args.pairs, engine=engine, max_len=engine.shape.max_len)
    config = SweepConfig(sweeps=tuple(args.sweeps.split(",")), max_requests=args.max_requests)
    shape = engine.shape
    runs = count_runs(pairs, config, shape.n_layers, shape.n_heads)
    cache, _ = load_or_build(engine, pairs, cache_spec(config, shape.n_layers), Path(tempfile.mkdtemp()),
                             log=lambda *_: None)
    # warm-up: the first sweep asked for, on one pair (the cache holds only what the asked sweeps read)
    run_sweeps(engine, pairs[:1], cache, replace(config, sweeps=config.sweeps[:1], trace_samples=1))

    t0 = time.perf_counter()
    rows = run_sweeps(engine, pairs, cache, config)
    t_engine = time.perf_counter() - t0

    # the same token lists, no plan, straight through vLLM
    from vllm import SamplingParams, TokensPrompt

    ctx = SweepContext(config, shape.n_layers, shape.n_heads)
    tokens = [req.tokens for *_, req in patched_runs(pairs, ctx)]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    t0 = time.perf_counter()
    for k in range(0, len(tokens), args.max_requests):
        engine.llm.generate([TokensPrompt(prompt_token_ids=list(t)) for t in tokens[k:k + args.max_requests]],
                            params, use_tqdm=False)
    t_plain = time.perf_counter() - t0
    engine.close()

    hf = load_engine(args.model, "hf", batch_size=256)
    t0 = time.perf_counter()
    hf_rows = run_sweeps(hf, pairs, cache, config)
    t_hf = time.perf_counter() - t0
    diffs = sorted(abs(a["recovery"] - b["recovery"]) for a, b in zip(rows, hf_rows)
                   if a["recovery"] is not None and b["recovery"] is not None)

    per_min = lambda t: len(pairs) * 60 / t  # noqa: E731
    print(f"model {args.model}, {len(pairs)} pairs over {len({p.relation for p in pairs})} relations, "
          f"sweeps {args.sweeps}: {runs} patched runs ({runs / len(pairs):.0f} per pair), "
          f"{sum(len(t) for t in tokens)} tokens; cache {cache.bytes_per_pair / 1e3:.0f} kB per pair")
    print(f"{'engine (vLLM)':<26} {per_min(t_engine):8.2f} pairs/min  ({runs / t_engine:7.1f} patched runs/s)")
    print(f"{'hf batched reference':<26} {per_min(t_hf):8.2f} pairs/min  ({runs / t_hf:7.1f} patched runs/s)")
    print(f"{'plain vLLM prefill':<26} {'':8}            ({runs / t_plain:7.1f} runs/s)")
    print(f"engine / hf-batch            = {t_hf / t_engine:5.2f}x")
    print(f"intervention overhead        = {t_engine / t_plain:5.2f}  (engine sweep time / plain prefill time; "
          "target <= 1.25)")
    print(f"recovery, engine vs hf (bf16 kernels differ): median |diff| {diffs[len(diffs) // 2]:.4f}, "
          f"99th percentile {diffs[int(len(diffs) * 0.99)]:.4f}")


if __name__ == "__main__":
    main()
