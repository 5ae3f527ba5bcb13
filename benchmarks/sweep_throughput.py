"""Pairs per minute on smollm2-135m with patched runs starting at their lowest patched layer
(skip) against the same sweeps running every layer (full), for the default sweep set and for
causal tracing; the intervention overhead; and what scoring answers of several tokens whole costs
against scoring their first tokens, on the same pairs.

In one process, on the same pairs, the same engine and the same activation cache:
  skip   patchgrid's sweeps on the vLLM backend, each patched run started mid-stack (the default)
  full   the same sweeps with SweepConfig(start_midstack=False): every patched run computes every layer
  plain  vLLM prefill of exactly the full runs' token lists with no intervention at all

  whole  the default sweep set over pairs whose answers have several tokens, scored whole
  first  the same pairs with each answer cut to its first token (one forward per patched run)

Each way is timed `--repeats` times, the ways interleaved (skip, full, plain, skip, ...), and the
median printed, so that other work on shared cores moves each figure alike. Beside the overhead
(the medians' ratio, which the target is judged on), each repeat's own ratio of its full sweep to
the plain prefill timed after it, lowest to highest, and the quickest full sweep over the quickest
plain prefill: on shared cores other work only ever adds time, so these show how far it moved the
figure. The model runs in its
own dtype, or in float32 on a CPU without bf16 units (patchgrid.runtime.machine.machine_dtype; --dtype).
Targets: intervention overhead (full / plain) <= 1.15 on tiny-llama; skip / full >= 1.9
for the default sweep set and >= 1.8 for causal tracing on smollm2-135m.
Beside each engine figure, its agreement with a Hugging Face float32 reference on the same pairs
(benchmarks/agreement.py: top-1, total variation, largest metric difference; supported, degraded or
wrong), the engine run as the figure ran it (started mid-stack or every layer).

    .venv/bin/python benchmarks/sweep_throughput.py [--model smollm2-135m] [--dtype auto|float32|...]
        [--pairs 4] [--trace-pairs 1] [--trace-samples 5] [--answer-pairs 2] [--repeats 3]

The default set runs over 4 pairs, swept together as a study sweeps a shard's pairs (8 by default,
StudySpec.shard_size): the runs of one start layer share an engine step, so the pairs set how many
rows a started step multiplies. Over 2 pairs a started step of smollm2 held about 1,000 rows, a size
at which oneDNN, in bf16 on a 2-core AMX machine, multiplies two of the four linear layers on one
core (benchmarks/cpu_linears.py): skip / full read 1.41x there against 1.74-1.94x over 4 pairs and
1.94-1.95x over 8 (docs/benchmarks.md). Its defaults finish in about 10 minutes on a 2-core machine
(11 min in float32 on a 2-core Intel machine with AMX).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed_sweeps(engine, pairs, cache, config, noise_std):
    from patchgrid.sweeps import run_sweeps

    t0 = time.perf_counter()
    rows = run_sweeps(engine, pairs, cache, config, noise_std=noise_std)
    return time.perf_counter() - t0, rows


def differences(a, b) -> str:
    """|skip - full| on the rows' recovery (or trace effect) and patched p: median, 99th pct, max."""
    key = lambda r: (r["pair_id"], r["sweep"], r["site"], r["direction"], r["layer"], r["position"],  # noqa: E731
                     r["head"], r["window"])
    other = {key(r): r for r in b}
    out = []
    for field in ("recovery" if a[0]["sweep"] != "trace" else "effect", "patched_p"):
        d = sorted(abs(r[field] - other[key(r)][field]) for r in a
                   if r[field] is not None and other[key(r)][field] is not None)
        if not d:  # a metric the runs did not read (--metrics)
            continue
        out.append(f"{field} median {d[len(d) // 2]:.1e}, 99th pct {d[int(len(d) * 0.99)]:.1e}, max {d[-1]:.1e}")
    return "; ".join(out)


def judged(pairs) -> list[tuple]:
    """The pairs as benchmarks.agreement takes them."""
    return [(p.clean_ids, p.corrupt_ids, p.clean_answer_ids, p.corrupt_answer_ids) for p in pairs]


def agreement(judge, engine, started: bool, pairs) -> str:
    return "" if judge is None else "\n" + judge.line(engine, started, judged(pairs))


def full_run_tokens(engine, pairs, config, noise_std) -> list[tuple]:
    """The token lists of the sweeps' patched runs, every layer computed (start_midstack off)."""
    from patchgrid.sweeps import SweepContext, patched_runs

    shape = engine.shape
    ctx = SweepContext(replace(config, start_midstack=False), shape.n_layers, shape.n_heads, noise_std)
    return [req.tokens for *_, req in patched_runs(pairs, ctx)]


def plain_prefill(engine, tokens, max_requests: int) -> None:
    """vLLM's own prefill of `tokens`, no intervention, in calls of at most `max_requests`, driven as
    patchgrid drives vLLM (VllmEngine._prefill: one SamplingParams shared without a deep copy, final
    outputs only, the engine's add_request / step loop) with Python's cyclic garbage collector paused
    as for an engine call: the engine's own floor, not a slower way to call it. Outside a call
    (pg_begin / pg_end) no hook is installed, so these forwards are plain."""
    from patchgrid.runtime.collector import cyclic_gc_paused

    for k in range(0, len(tokens), max_requests):
        with cyclic_gc_paused():
            engine._prefill(next(engine._calls), tokens[k:k + max_requests])


def compare(name, engine, pairs, config, noise_std, plain=False, judge=None, repeats=3):
    from patchgrid.cache import load_or_build
    from patchgrid.sweeps import cache_spec, count_runs

    shape = engine.shape
    cache, _ = load_or_build(engine, pairs, cache_spec(config, shape.n_layers, noise_std), Path(tempfile.mkdtemp()),
                             log=lambda *_: None)
    warm = replace(config, trace_samples=1)
    for skip in (True, False):  # warm-up: the first calls pay one-off costs
        timed_sweeps(engine, pairs[:1], cache, replace(warm, start_midstack=skip), noise_std)
    tokens = full_run_tokens(engine, pairs, config, noise_std) if plain else None
    times = {"skip": [], "full": [], "plain": []}
    for _ in range(repeats):  # interleaved: other work on shared cores slows every way alike
        t, rows_skip = timed_sweeps(engine, pairs, cache, config, noise_std)
        times["skip"].append(t)
        t, rows_full = timed_sweeps(engine, pairs, cache, replace(config, start_midstack=False), noise_std)
        times["full"].append(t)
        if plain:
            t0 = time.perf_counter()
            plain_prefill(engine, tokens, config.max_requests)
            times["plain"].append(time.perf_counter() - t0)
    t_skip, t_full = statistics.median(times["skip"]), statistics.median(times["full"])
    runs = count_runs(pairs, config, shape.n_layers, shape.n_heads)
    per_min = lambda t: len(pairs) * 60 / t  # noqa: E731
    print(f"{name}: {len(pairs)} pairs, {runs} patched runs ({runs / len(pairs):.0f} per pair), median of "
          f"{repeats}; cache {cache.bytes_per_pair / 1e6:.2f} MB per pair (streams included)")
    print(f"  {'skip (start mid-stack)':<24} {per_min(t_skip):8.2f} pairs/min  ({runs / t_skip:7.1f} patched runs/s)"
          f"{agreement(judge, engine, True, pairs)}")
    print(f"  {'full forward':<24} {per_min(t_full):8.2f} pairs/min  ({runs / t_full:7.1f} patched runs/s)"
          f"{agreement(judge, engine, False, pairs)}")
    print(f"  skip / full = {t_full / t_skip:5.2f}x  (target on smollm2-135m: >= {skip_target(config):.1f})")
    print(f"  |skip - full| ({str(engine.dtype).removeprefix('torch.')}): {differences(rows_skip, rows_full)}")
    if plain:
        t_plain = statistics.median(times["plain"])
        paired = sorted(f / p for f, p in zip(times["full"], times["plain"]))  # each repeat's, timed side by side
        quickest = min(times["full"]) / min(times["plain"])
        print(f"  {'plain vLLM prefill':<24} {'':8}            ({runs / t_plain:7.1f} runs/s): intervention overhead "
              f"(full / plain) = {t_full / t_plain:4.2f} (target on tiny-llama: <= 1.15); each repeat's "
              f"{paired[0]:4.2f} to {paired[-1]:4.2f}, the quickest of each {quickest:4.2f}")


def skip_target(config) -> float:
    return 1.8 if config.sweeps == ("trace",) else 1.9


def answer_cost(engine, pairs, config, judge=None):
    """Seconds per pair of the sweeps with answers scored whole against the same pairs' first tokens."""
    from patchgrid.cache import load_or_build
    from patchgrid.plan import forwards
    from patchgrid.sweeps import SweepContext, cache_spec, count_runs, patched_runs

    first = [replace(p, clean_answer_ids=p.clean_answer_ids[:1], corrupt_answer_ids=p.corrupt_answer_ids[:1])
             for p in pairs]
    times = {}
    for name, ps in (("whole", pairs), ("first", first)):
        cache, _ = load_or_build(engine, ps, cache_spec(config, engine.shape.n_layers), Path(tempfile.mkdtemp()),
                                 log=lambda *_: None)
        timed_sweeps(engine, ps[:1], cache, config, 0.0)  # warm-up
        times[name], _ = timed_sweeps(engine, ps, cache, config, 0.0)
    ctx = SweepContext(config, engine.shape.n_layers, engine.shape.n_heads)
    reqs = [req for *_, req in patched_runs(pairs, ctx)]
    n_fwd = sum(len(forwards(r)) for r in reqs)
    tokens = sum(len(f.tokens) for r in reqs for f in forwards(r))
    runs = count_runs(pairs, config, engine.shape.n_layers, engine.shape.n_heads)
    lengths = ", ".join(f"{len(p.clean_answer_ids)}+{len(p.corrupt_answer_ids)}" for p in pairs)
    print(f"answers scored whole against their first tokens: {len(pairs)} pairs (answer tokens clean+corrupt: "
          f"{lengths}), {runs} patched runs; whole: {n_fwd / len(reqs):.2f} forwards and "
          f"{tokens / len(reqs):.1f} tokens per run")
    for name, ps in (("whole", pairs), ("first", first)):
        print(f"  {name + (' (scored whole)' if name == 'whole' else ' tokens only'):<24} "
              f"{len(pairs) * 60 / times[name]:8.2f} pairs/min  ({runs / times[name]:7.1f} patched runs/s)"
              f"{agreement(judge, engine, config.start_midstack, ps)}")
    print(f"  whole / first tokens = {times['whole'] / times['first']:5.2f}x the time")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None,
                        help="the model's dtype (default: its own, or float32 on a CPU without bf16 units)")
    parser.add_argument("--repeats", type=int, default=3, help="timed sweeps per way, interleaved (median printed)")
    parser.add_argument("--pairs", type=int, default=4,
                        help="pairs for the default sweep set, swept together as a study's shard is (0: skip it)")
    parser.add_argument("--trace-pairs", type=int, default=1, help="facts for causal tracing (0: skip it)")
    parser.add_argument("--trace-samples", type=int, default=5)
    parser.add_argument("--sweeps", default="resid,attn_out,mlp_out,heads")
    parser.add_argument("--max-requests", type=int, default=2048)
    parser.add_argument("--answer-pairs", type=int, default=2,
                        help="pairs with answers of several tokens, scored whole and by first token (0: skip it)")
    parser.add_argument("--no-agreement", action="store_true", help="leave out the agreement with hf float32")
    parser.add_argument("--metrics", default=None,
                        help="the metrics the patched runs read, a comma list (SweepConfig.metrics; default: all)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from benchmarks.agreement import Judge
    from patchgrid.backends.engine import load_engine
    from patchgrid.runtime.machine import machine, machine_dtype
    from patchgrid.sweeps import SweepConfig
    from tests.support.pairs import noise_std_for, shipped_pairs

    print(machine())
    dtype, why = machine_dtype(args.dtype)
    plan = [f"{args.pairs} pairs x sweeps {args.sweeps} (skip, full, plain prefill)"] if args.pairs else []
    if args.trace_pairs:
        plan.append(f"causal tracing of {args.trace_pairs} facts x {args.trace_samples} samples (skip, full)")
    if args.answer_pairs:
        plan.append(f"{args.answer_pairs} pairs with answers of several tokens, whole and first tokens")
    metrics = {} if args.metrics is None else {"metrics": tuple(args.metrics.split(","))}
    plan.append(f"patched runs reading {args.metrics or 'every metric'}")
    print(f"will run on {args.model} in {dtype} ({why}): {'; '.join(plan)}; each timed {args.repeats} times"
          + ("" if args.no_agreement else "; each figure judged against hf float32"))
    engine = load_engine(args.model, "vllm", dtype=dtype)
    tok = AutoTokenizer.from_pretrained(engine.folder)
    pairs = shipped_pairs(tok, max(args.pairs, args.trace_pairs), engine=engine, max_len=engine.shape.max_len)
    print(f"model {args.model} ({str(engine.dtype).removeprefix('torch.')}), {engine.shape.n_layers} layers")
    config = SweepConfig(sweeps=tuple(args.sweeps.split(",")), max_requests=args.max_requests, **metrics)
    judge = None if args.no_agreement else Judge(args.model)
    if args.pairs:
        compare(f"sweeps {args.sweeps}", engine, pairs[:args.pairs], config, 0.0, plain=True, judge=judge,
                repeats=args.repeats)
    if args.trace_pairs:
        facts = pairs[:args.trace_pairs]
        trace = SweepConfig(sweeps=("trace",), trace_samples=args.trace_samples, max_requests=args.max_requests,
                            **metrics)
        compare(f"causal tracing ({args.trace_samples} samples, hidden state + MLP + attention windows)", engine,
                facts, trace, noise_std_for(engine, facts), judge=judge, repeats=args.repeats)
    if args.answer_pairs:
        many = shipped_pairs(tok, 10_000, engine=engine, max_len=engine.shape.max_len, answer_policy="full")
        longer = [p for p in many if len(p.clean_answer_ids) > 1 or len(p.corrupt_answer_ids) > 1]
        answer_cost(engine, longer[:args.answer_pairs], config, judge)
    if judge is not None:
        judge.close()
    engine.close()


if __name__ == "__main__":
    main()
