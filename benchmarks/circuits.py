"""Edges and circuits on smollm2-135m and the shipped IOI set: every edge scored by EAP
and EAP-IG, the strongest and a random sample confirmed exactly on vLLM, circuits judged by
faithfulness at MIB's ten sizes, against exhaustive exact edge patching of the same pairs.

In one process, on the same pairs and the same vLLM engine:
  eap        EAP scores of every edge of every pair (the hf model, float32): edges scored per second
  eap-ig     EAP-IG scores (--ig-steps inputs per pair), likewise
  edges      the edges sweep: EAP-IG scores, then per pair the top K by |score| and R sampled from
             the rest patched exactly by path patching on vLLM: patched runs per second, and the
             agreement of scores and exact effects (edge_agreement, with bootstrap intervals)
  exhaustive every edge of every pair patched exactly, one path each: run on a random sample of
             --exhaustive-sample edges of one pair, and extrapolated to every edge of every pair
             (stated as such: not run)

  circuits   per method (EAP, EAP-IG), the circuit sweep at MIB's ten sizes (patching ablation): the
             circuit runs on vLLM (nine per pair: the full circuit is the clean run and the empty one
             the corrupt run, read from the baselines), in patched runs per second and wall time
             (the engine's calls timed alone: no edge is confirmed there), and MIB's CPR and CMD
             (circuit_score) with the faithfulness of the 1% and 10% circuits (circuit_curve)

    .venv/bin/python benchmarks/circuits.py [--pairs 8] [--ig-steps 30] [--top 20] [--random 20]
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

IOI = Path(__file__).resolve().parents[1] / "data" / "pairs" / "ioi.jsonl"


def ioi_pairs(engine, n: int):
    """The first n IOI pairs the model knows (clean and corrupt answered right)."""
    from transformers import AutoTokenizer

    from patchgrid.pairs import accepted_pairs, build_pairs, read_source, to_table
    from patchgrid.pairs.limit import Limit

    tok = AutoTokenizer.from_pretrained(engine.folder)
    _, records = read_source(str(IOI))
    rows = build_pairs(records, tok, max_len=engine.shape.max_len, engine=engine, require_known=True,
                       answer_policy="single", limit=Limit(n))
    return accepted_pairs(to_table(rows))[:n]


def warehouse_of(pairs, rows, params: dict):
    """The rows loaded as one run (`bench`) of a fresh warehouse; a read-only connection to it."""
    from patchgrid.pairs import to_table
    from patchgrid.rows.effects import write_effects
    from patchgrid.sweeps.registry import row_shapes
    from patchgrid.warehouse.loader import connect, load_run, start_run

    folder = Path(tempfile.mkdtemp())
    wh = folder / "w.duckdb"
    records = [{"pair_id": p.pair_id, "relation": p.relation, "status": "accepted", "roles": list(p.roles),
                "subject_start": p.subject_start, "subject_end": p.subject_end} for p in pairs]
    start_run(wh, {"run_id": "bench", "model": "m", "params": params})
    load_run(wh, "bench", to_table(records), [], [write_effects(rows, folder / "rows.parquet")],
             sweep_kinds=row_shapes())
    return connect(wh)


def edge_agreement_of(pairs, rows):
    """The edge agreement of the rows, with bootstrap intervals."""
    from patchgrid.warehouse.agreement import edge_agreement

    con = warehouse_of(pairs, rows, {"edge_method": "eap-ig"})
    try:
        return edge_agreement(con, "bench")
    finally:
        con.close()


def circuits_of(pairs, rows, method: str):
    """circuit_score's row and circuit_curve's faithfulness by size of the rows."""
    con = warehouse_of(pairs, rows, {"edge_method": method, "circuit_build": "topn"})
    try:
        score = con.execute("SELECT cpr, cmd FROM circuit_score WHERE run_id = 'bench'").fetchone()
        curve = dict(con.execute("SELECT size, faithfulness FROM circuit_curve WHERE run_id = 'bench'").fetchall())
        return score, curve
    finally:
        con.close()


def interval(a, name) -> str:
    if a[name] is None:
        return "-"
    low, high = a[f"{name}_ci95_low"], a[f"{name}_ci95_high"]
    return f"{a[name]:.2f}" + ("" if low is None else f" [{low:.2f}, {high:.2f}]")


def exhaustive_rate(engine, scorer, pair, cache, n_sample: int, seed: int) -> tuple[float, int]:
    """Seconds per edge when every edge is patched exactly (path patching, one path each), timed on a
    random sample of one pair's edges (the edges sweep with K = 0 and R = n_sample, EAP scores, less
    the time of those scores): (seconds per edge, edges timed)."""
    from patchgrid.sweeps import SweepConfig, run_sweeps

    config = SweepConfig(sweeps=("edges",), edge_method="eap", verify_top=0, verify_random=n_sample, seed=seed)
    t0 = time.perf_counter()
    rows = run_sweeps(engine, [pair], cache, config, attributor=scorer.at)
    took = time.perf_counter() - t0
    t0 = time.perf_counter()
    scorer.scores([pair], "eap")
    scoring = time.perf_counter() - t0
    timed = sum(1 for r in rows if r.get("verify") is not None)
    return max(took - scoring, 0.0) / timed, timed


class TimedEngine:
    """An engine whose `run` calls are timed (seconds, summed); everything else is the engine's."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, requests, sources=None):
        return self._timed(self.engine.run, requests, sources)

    def readings(self, requests, sources=None):
        return self._timed(self.engine.readings, requests, sources)

    def _timed(self, call, requests, sources):
        t0 = time.perf_counter()
        try:
            return call(requests, sources)
        finally:
            self.seconds += time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None,
                        help="the model's dtype on vLLM (default: its own, or float32 on a CPU without bf16 units)")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--ig-steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=20, help="K: edges per pair patched by score")
    parser.add_argument("--random", type=int, default=20, help="R: edges per pair sampled from the rest")
    parser.add_argument("--exhaustive-sample", type=int, default=200,
                        help="edges of one pair patched exactly to time exhaustive edge patching")
    args = parser.parse_args()

    from patchgrid.backends.engine import load_engine
    from patchgrid.cache import load_or_build
    from patchgrid.methods.attribution import Attributor
    from patchgrid.methods.edge_attribution import EdgeScorer
    from patchgrid.runtime.machine import machine, machine_dtype
    from patchgrid.sweeps import SweepConfig, cache_spec, run_sweeps

    print(machine())
    dtype, why = machine_dtype(args.dtype)
    print(f"will run on {args.model} in {dtype} on vLLM ({why}), float32 for the gradients: {args.pairs} IOI pairs; "
          f"EAP and EAP-IG ({args.ig_steps} steps) scores of every edge; the edges sweep confirming the top "
          f"{args.top} and {args.random} random edges per pair; {args.exhaustive_sample} edges of one pair patched "
          "exactly to time exhaustive edge patching (extrapolated)")
    engine = load_engine(args.model, "vllm", dtype=dtype)
    shape = engine.shape
    pairs = ioi_pairs(engine, args.pairs)
    attributor = Attributor.load(engine.folder, shape)
    scorer = EdgeScorer(attributor)
    n_edges = len(scorer.graph.edges)
    print(f"model {args.model} ({str(engine.dtype).removeprefix('torch.')} on vLLM, float32 gradients), "
          f"{shape.n_layers} layers x {shape.n_heads} heads ({shape.kv_heads} key/value heads): {n_edges:,} edges; "
          f"{len(pairs)} pairs ({sum(len(p.corrupt_ids) for p in pairs) / len(pairs):.1f} tokens on average)")
    scorer.scores(pairs[:1])  # warm-up

    scoring = {}
    for method, steps in (("eap", 1), ("eap-ig", args.ig_steps)):
        t0 = time.perf_counter()
        scorer.scores(pairs, method, steps)
        took = scoring[method] = time.perf_counter() - t0
        print(f"{method:7s} {took:7.1f} s: {n_edges * len(pairs) / took:,.0f} edges scored per second "
              f"({took / len(pairs):.2f} s per pair)")

    config = SweepConfig(sweeps=("edges",), edge_method="eap-ig", ig_steps=args.ig_steps, verify_top=args.top,
                         verify_random=args.random)
    cache, _ = load_or_build(engine, pairs, cache_spec(config, shape.n_layers), Path(tempfile.mkdtemp()),
                             log=lambda *_: None)
    t0 = time.perf_counter()
    rows = run_sweeps(engine, pairs, cache, config, attributor=attributor)
    t_sweep = time.perf_counter() - t0
    verified = [r for r in rows if r.get("verify") is not None]
    print(f"edges sweep: {len(rows):,} edge rows, {len(verified)} edges patched exactly, {t_sweep:.1f} s in all")

    per_edge, timed = exhaustive_rate(engine, scorer, pairs[0], cache, args.exhaustive_sample, seed=0)
    every = n_edges * len(pairs)
    hours = every * per_edge / 3600
    print(f"exhaustive exact edge patching: {per_edge * 1000:.1f} ms per edge, timed on {timed} random edges of one "
          f"pair; every edge of the {len(pairs)} pairs ({every:,} paths) would take about {hours:.1f} hours "
          f"(extrapolated, not run), {every * per_edge / t_sweep:,.0f}x the edges sweep")
    for a in edge_agreement_of(pairs, rows):
        print(f"  agreement on {a['metric']} (95% bootstrap intervals over pairs): Pearson (random) "
              f"{interval(a, 'pearson_random')}, Spearman (random) {interval(a, 'spearman_random')}, recall of the "
              f"important edges {interval(a, 'recall_important')} ({a['n_pairs']} pairs, {a['n_random_verified']} "
              f"random edges; pooled Pearson {a['pearson_pooled']:.2f})")
    circuit_time = {}
    for method in ("eap", "eap-ig"):
        config = SweepConfig(sweeps=("edges", "circuit"), edge_method=method, ig_steps=args.ig_steps, verify_top=0,
                             verify_random=0)
        cache, _ = load_or_build(engine, pairs, cache_spec(config, shape.n_layers), Path(tempfile.mkdtemp()),
                                 log=lambda *_: None)
        timed = TimedEngine(engine)  # with no edge confirmed, its every call is circuit runs
        rows = run_sweeps(timed, pairs, cache, config, attributor=attributor)
        took = circuit_time[method] = timed.seconds
        sizes = len(config.circuit_sizes)
        runs = len(pairs) * (sizes - 1)  # the empty and the full circuits are the corrupt and clean runs
        (cpr, cmd), curve = circuits_of(pairs, rows, method)
        print(f"circuits from {method:6s}: {runs} circuit runs ({len(pairs)} pairs x {sizes - 1} sizes) in "
              f"{took:.1f} s, {runs / took:.2f} patched runs per second; CPR {cpr:.3f}, CMD {cmd:.3f}; "
              f"faithfulness at 1% {curve.get(1.0, float('nan')):.3f}, at 10% {curve.get(10.0, float('nan')):.3f}")
    print(f"  the ten-size faithfulness evaluation of {len(pairs)} pairs: {circuit_time['eap-ig']:.1f} s on vLLM, "
          f"against about {hours:.1f} hours for exhaustive exact edge patching of the same pairs (extrapolated)")
    engine.close()


if __name__ == "__main__":
    main()
