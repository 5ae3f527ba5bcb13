"""Patched runs per second for a full layer x position resid sweep on smollm2-135m, four ways:

  skip     patchgrid's vLLM backend, each patched run starting at the layer above its patch from
           the corrupt run's cached stream (plan.Start; what a study does by default)
  full     patchgrid's vLLM backend, every patched run computing every layer
  hf-loop  Hugging Face, one patched run per forward (TransformerLens's helpers, most tutorials)
  hf-batch Hugging Face, all patched runs of the sweep in one batched forward

All four run in this process on the same sweep, in the model's own dtype or in float32 on a CPU
without bf16 units (patchgrid.runtime.machine.machine_dtype; --dtype); the figures that matter are the ratios.
Targets: skip >= 2.0x hf-batch; full >= 1.0x hf-batch; skip >= 10x hf-loop. Beside each figure, its
agreement with a Hugging Face float32 reference (benchmarks/agreement.py: top-1, total variation,
largest metric difference; supported, degraded or wrong) on a sample of the same pairs' patched runs.

    .venv/bin/python benchmarks/engine_throughput.py [--model smollm2-135m] [--dtype ...] [--repeats 3]
        [--loop-runs 500]

Its defaults finish in about 10 minutes on a 2-core machine (in float32, 15 min 41 s with
5 repeats and the loop over all 3,120 runs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_sweep(engine, pairs):
    """The grids' requests without starts and with them, and the clean and corrupt runs' captures.
    pairs: (clean ids, corrupt ids, clean answer, corrupt answer)."""
    from dataclasses import replace

    from patchgrid.plan import Patch, Request, Start, latest_start

    n_layers = engine.shape.n_layers
    keys = tuple(f"resid.{layer}" for layer in range(n_layers))
    reqs, started, sources = [], [], {}
    for i, (clean_ids, corrupt_ids, *answers) in enumerate(pairs):
        clean, corrupt = engine.run([Request(tokens=clean_ids, answers=tuple(answers), capture=keys),
                                     Request(tokens=corrupt_ids, answers=tuple(answers), capture=keys)])
        sources.update({f"{i}:clean": clean.captures, f"{i}:corrupt": corrupt.captures})
        grid = [Request(tokens=corrupt_ids, answers=tuple(answers),
                        patches=(Patch("resid", layer, f"{i}:clean", (pos,)),))
                for layer in range(n_layers) for pos in range(len(clean_ids))]
        reqs += grid
        started += [replace(r, start=Start(latest_start(r.patches, n_layers), f"{i}:corrupt")) for r in grid]
    return reqs, started, sources


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
    parser.add_argument("--dtype", default=None,
                        help="the model's dtype (default: its own, or float32 on a CPU without bf16 units)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop-repeats", type=int, default=1, help="repeats of the slow one-per-forward loop")
    parser.add_argument("--loop-runs", type=int, default=500,
                        help="patched runs the one-per-forward loop is timed on, the grid's first (0: all): "
                             "each is its own forward, so its rate does not depend on how many")
    parser.add_argument("--pairs", type=int, default=16,
                        help="France/Germany, then shipped pairs: the grid of each, all in one engine call")
    parser.add_argument("--no-agreement", action="store_true", help="leave out the agreement with hf float32")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from benchmarks.agreement import Judge
    from patchgrid.backends.engine import load_engine
    from patchgrid.model.models import prepare
    from patchgrid.pipeline.one_pair import tokenize_pair
    from patchgrid.runtime.machine import machine, machine_dtype

    tok = AutoTokenizer.from_pretrained(prepare(args.model))
    pair = tokenize_pair(tok, "The capital of France is", "The capital of Germany is", " Paris", " Berlin")
    pairs = [(pair.clean, pair.corrupt, pair.clean_answer, pair.corrupt_answer)]
    judged = [(pair.clean, pair.corrupt, pair.clean_answer_ids, pair.corrupt_answer_ids)]
    if args.pairs > 1:
        from tests.support.pairs import shipped_pairs

        shipped = shipped_pairs(tok, args.pairs - 1)
        pairs += [(p.clean_ids, p.corrupt_ids, p.clean_answer_id, p.corrupt_answer_id) for p in shipped]
        judged += [(p.clean_ids, p.corrupt_ids, p.clean_answer_ids, p.corrupt_answer_ids) for p in shipped]
    judge = Judge(args.model, judged)
    agree = {}  # figure -> its agreement line, judged while its engine is up

    def judge_figure(name, engine, started):
        agree[name] = "" if args.no_agreement else "\n" + judge.line(engine, started)

    print(machine())
    dtype, why = machine_dtype(args.dtype)
    print(f"will run on {args.model} in {dtype} ({why}): the resid grid of {len(pairs)} pairs four ways (vLLM "
          f"skipping and every layer, hf batched: median of {args.repeats}; hf one run per forward: "
          f"{args.loop_runs or 'all'} runs, {args.loop_repeats} time{'s' if args.loop_repeats > 1 else ''})"
          + ("" if args.no_agreement else "; each figure judged against hf float32"))
    engine = load_engine(args.model, "vllm", dtype=dtype)
    reqs, started, sources = build_sweep(engine, pairs)
    skip_rate, skip_results = time_runs(engine, started, sources, args.repeats)
    full_rate, full_results = time_runs(engine, reqs, sources, args.repeats)
    judge_figure("skip", engine, True)
    judge_figure("full", engine, False)
    engine.close()

    hf_batch = load_engine(args.model, "hf", dtype=dtype, batch_size=len(reqs))
    batch_rate, batch_results = time_runs(hf_batch, reqs, sources, args.repeats)
    hf_loop = load_engine(args.model, "hf", dtype=dtype, batch_size=1)
    hf_loop.model = hf_batch.model  # same weights, one forward per patched run
    loop_rate, _ = time_runs(hf_loop, reqs[:args.loop_runs or len(reqs)], sources, args.loop_repeats)
    judge_figure("hf-batch", hf_batch, False)
    judge_figure("hf-loop", hf_loop, False)

    def worst(a, b):
        return max(float((x.answer_logits - y.answer_logits).abs().max()) for x, y in zip(a, b))

    dtype = str(engine.dtype).removeprefix("torch.")
    what = (f"{engine.shape.n_layers} layers x {len(pair.clean)} positions" if len(pairs) == 1 else
            f"{len(pairs)} pairs x {engine.shape.n_layers} layers x their positions")
    print(f"model {args.model} ({dtype}), resid grid: {what} = {len(reqs)} patched runs per sweep, "
          f"median of {args.repeats}")
    print(f"{'engine, skipping':<24} {skip_rate:>9.1f} patched runs/s{agree['skip']}")
    print(f"{'engine, full forward':<24} {full_rate:>9.1f} patched runs/s{agree['full']}")
    looped = min(args.loop_runs or len(reqs), len(reqs))
    print(f"{'hf one per forward':<24} {loop_rate:>9.1f} patched runs/s (timed on {looped} runs){agree['hf-loop']}")
    print(f"{'hf one batched forward':<24} {batch_rate:>9.1f} patched runs/s{agree['hf-batch']}")
    print(f"skip / hf-batch = {skip_rate / batch_rate:6.2f}x  (target >= 2.0)")
    print(f"full / hf-batch = {full_rate / batch_rate:6.2f}x  (target >= 1.0)")
    print(f"skip / full     = {skip_rate / full_rate:6.2f}x")
    print(f"skip / hf-loop  = {skip_rate / loop_rate:6.2f}x  (target >= 10)")
    print(f"largest answer-logit difference ({dtype}): skip vs full {worst(skip_results, full_results):.4f}, "
          f"full vs hf-batch {worst(full_results, batch_results):.4f}")
    judge.close()


if __name__ == "__main__":
    main()
