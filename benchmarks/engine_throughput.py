"""Patched runs per second for a full layer x position resid sweep on smollm2-135m, three ways:

  engine   patchgrid's vLLM backend, every patched run in one engine call
  hf-loop  Hugging Face, one patched run per forward (TransformerLens's helpers, most tutorials)
  hf-batch Hugging Face, all patched runs of the sweep in one batched forward

All three run in this process on the same sweep; the figures that matter are the ratios.
Target: engine >= 10x hf-loop and >= 1.0x hf-batch.

    .venv/bin/python benchmarks/engine_throughput.py [--model smollm2-135m] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_sweep(engine, pair):
    from patchgrid.plan import Patch, Request

    n_layers, n = engine.shape.n_layers, len(pair.clean)
    answers = (pair.clean_answer, pair.corrupt_answer)
    keys = tuple(f"resid.{layer}" for layer in range(n_layers))
    clean = engine.run([Request(tokens=pair.clean, answers=answers, capture=keys)])[0]
    reqs = [Request(tokens=pair.corrupt, answers=answers, patches=(Patch("resid", layer, "clean", (pos,)),))
            for layer in range(n_layers) for pos in range(n)]
    return reqs, {"clean": clean.captures}


def time_runs(engine, reqs, sources, repeats):
    engine.run(reqs[:8], sources)  # warm-up: the first call pays one-off costs
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = engine.run(reqs, sources)
        times.append(time.perf_counter() - t0)
    assert len(results) == len(reqs)
    return len(reqs) / statistics.median(times), results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-repeats", type=int, default=1, help="repeats of the slow one-per-forward loop")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from patchgrid.engine import load_engine
    from patchgrid.models import prepare
    from patchgrid.patching import tokenize_pair

    tok = AutoTokenizer.from_pretrained(prepare(args.model))
    pair = tokenize_pair(tok, "The capital of France is", "The capital of Germany is", " Paris", " Berlin")

    engine = load_engine(args.model, "vllm")
    reqs, sources = build_sweep(engine, pair)
    engine_rate, engine_results = time_runs(engine, reqs, sources, args.repeats)
    engine.close()

    hf_batch = load_engine(args.model, "hf", batch_size=len(reqs))
    batch_rate, batch_results = time_runs(hf_batch, reqs, sources, args.repeats)
    hf_loop = load_engine(args.model, "hf", batch_size=1)
    hf_loop.model = hf_batch.model  # same weights, one forward per patched run
    loop_rate, _ = time_runs(hf_loop, reqs, sources, args.loop_repeats)

    worst = max(float((a.answer_logits - b.answer_logits).abs().max()) for a, b in zip(engine_results, batch_results))
    print(f"model {args.model}, {engine.shape.n_layers} layers x {len(pair.clean)} positions = "
          f"{len(reqs)} patched runs per sweep, median of {args.repeats}")
    print(f"{'engine (vLLM)':<22} {engine_rate:>9.1f} patched runs/s")
    print(f"{'hf one per forward':<22} {loop_rate:>9.1f} patched runs/s")
    print(f"{'hf one batched forward':<22} {batch_rate:>9.1f} patched runs/s")
    print(f"engine / hf-loop  = {engine_rate / loop_rate:6.2f}x  (target >= 10)")
    print(f"engine / hf-batch = {engine_rate / batch_rate:6.2f}x  (target >= 1.0)")
    print(f"largest logit difference between engine and hf-batch: {worst:.4f} (bf16)")


if __name__ == "__main__":
    main()
