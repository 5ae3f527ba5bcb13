"""Attribution patching as a screen: estimate every site, patch the strongest exactly, against
the exhaustive exact sweep of the same sites, on smollm2-135m and shipped pairs.

In one process, on the same pairs, the same vLLM engine and the same activation cache:
  exhaustive  the resid, attn_out, mlp_out and heads sweeps (denoise) at every position one by one:
              one patched run per site
  screen      the atp sweep over the same sites: AtP estimates on the hf model (float32, one clean
              forward and one corrupt forward and backward per pair), then per pair and site kind
              and scope the top K by |estimate| and R sampled from the rest patched exactly on vLLM
  graddrop    the same screen ranking sites by AtP*'s GradDrop score
  neurons     the AtP estimates of every MLP neuron at every position, which no exhaustive sweep
              could patch one by one (its cost is extrapolated from the exhaustive sweep's rate)

Agreement, per site kind and scope (every position at once, or one position), as the warehouse
computes it (atp_agreement and warehouse/agreement.py, on a warehouse of the screen's and the
exhaustive sweep's rows): Pearson and Spearman of estimate and exact effect over the random sites
alone (unbiased for the sites outside the top K), the recall of the exact top K and top 10 sites by
|effect| among the screen's top K, and missed_share, each with its 95% bootstrap interval over pairs.
With the sweep setting atp_qk_fix (AtP*'s QK fix for q/k sites) present, the screen also covers q, k
and v (qkv) and runs with and without the fix. Targets: screen >= 10x faster than exhaustive,
recall >= 0.8.

    .venv/bin/python benchmarks/atp_screen.py [--pairs 16] [--top 20] [--random 20]
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

KINDS = ("resid", "attn_out", "mlp_out", "heads")


def qk_fix_setting() -> bool:
    """Whether the sweeps have the atp_qk_fix setting (AtP*'s QK fix, and q/k screened through qkv)."""
    from dataclasses import fields

    from patchgrid.sweeps import SweepConfig

    return "atp_qk_fix" in {f.name for f in fields(SweepConfig)}


def agreement_rows(pairs, rows, sweep_kinds) -> list[dict]:
    """The rows loaded as one run of a fresh warehouse, and its atp agreement with intervals."""
    from patchgrid.pairs import to_table
    from patchgrid.rows.effects import write_effects
    from patchgrid.warehouse.agreement import agreement
    from patchgrid.warehouse.loader import connect, load_run, start_run

    folder = Path(tempfile.mkdtemp())
    wh = folder / "w.duckdb"
    records = [{"pair_id": p.pair_id, "relation": p.relation, "status": "accepted", "roles": list(p.roles),
                "subject_start": p.subject_start, "subject_end": p.subject_end} for p in pairs]
    start_run(wh, {"run_id": "bench", "model": "m"})
    load_run(wh, "bench", to_table(records), [], [write_effects(rows, folder / "rows.parquet")],
             sweep_kinds=sweep_kinds)
    con = connect(wh)
    try:
        return agreement(con, "bench")
    finally:
        con.close()


def interval(a, name) -> str:
    if a[name] is None:
        return "-"
    low, high = a[f"{name}_ci95_low"], a[f"{name}_ci95_high"]
    return f"{a[name]:.2f}" + ("" if low is None else f" [{low:.2f}, {high:.2f}]")


def print_agreement(label, rows):
    print(f"  agreement, {label} (95% bootstrap intervals over pairs):")
    for a in rows:
        print(f"    {a['site']:8s} {a['scope']:14s} Pearson (random) {interval(a, 'pearson_random'):20s} "
              f"Spearman (random) {interval(a, 'spearman_random'):20s} recall top K {interval(a, 'recall_top_k'):20s} "
              f"recall top 10 {interval(a, 'recall_top_10'):20s} missed_share {interval(a, 'missed_share')} "
              f"({a['n_pairs']} pairs, {a['n_random_verified']} random sites)")


def sweep(engine, pairs, cache, config, attributor=None):
    """Seconds and rows of `config` over the pairs."""
    from patchgrid.sweeps import run_sweeps

    t0 = time.perf_counter()
    rows = run_sweeps(engine, pairs, cache, config, attributor=attributor)
    return time.perf_counter() - t0, rows


def key(r):
    return (r["pair_id"], r["site"], r["layer"], r["position"], r["head"], r["neuron"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default=None,
                        help="the model's dtype on vLLM (default: its own, or float32 on a CPU without bf16 units)")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--top", type=int, default=20,
                        help="K: sites per pair, site kind and scope patched by estimate")
    parser.add_argument("--random", type=int, default=20,
                        help="R: sites per pair, site kind and scope sampled from the rest")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from patchgrid.backends.engine import load_engine
    from patchgrid.cache import load_or_build
    from patchgrid.methods.attribution import Attributor
    from patchgrid.runtime.machine import machine, machine_dtype
    from patchgrid.sweeps import SweepConfig, cache_spec, count_runs
    from patchgrid.sweeps.registry import row_shapes
    from tests.support.pairs import shipped_pairs

    print(machine())
    dtype, why = machine_dtype(args.dtype)
    print(f"will run on {args.model} in {dtype} on vLLM ({why}), float32 for the gradients: {args.pairs} pairs, "
          f"every site patched exactly against attribution patching's screen confirmed for the top {args.top} "
          f"and {args.random} random sites per pair")
    engine = load_engine(args.model, "vllm", dtype=dtype)
    shape = engine.shape
    tok = AutoTokenizer.from_pretrained(engine.folder)
    pairs = shipped_pairs(tok, args.pairs, engine=engine, max_len=shape.max_len, answer_policy="full")
    n_tokens = sum(len(p.corrupt_ids) for p in pairs)
    print(f"model {args.model} ({str(engine.dtype).removeprefix('torch.')} on vLLM, float32 for the gradients), "
          f"{shape.n_layers} layers x {shape.n_heads} heads, {shape.d_mlp} neurons per layer; {len(pairs)} pairs "
          f"({n_tokens / len(pairs):.1f} tokens on average)")

    # every site at every position one by one: resid, attn_out, mlp_out by default, heads by head_positions
    qk = qk_fix_setting()
    kinds = KINDS + (("qkv",) if qk else ())
    exhaustive = SweepConfig(sweeps=kinds, resid_directions=("denoise",), head_positions="every")
    screen = SweepConfig(sweeps=("atp",), atp_kinds=kinds, verify_top=args.top, verify_random=args.random,
                         head_positions="every", **({"atp_qk_fix": True} if qk else {}))
    if not qk:
        print("no atp_qk_fix setting in this patchgrid: plain AtP only, q/k not screened")
    t0 = time.perf_counter()
    cache, _ = load_or_build(engine, pairs, cache_spec(exhaustive, shape.n_layers), Path(tempfile.mkdtemp()),
                             log=lambda *_: None)
    t_cache = time.perf_counter() - t0
    attributor = Attributor.load(engine.folder, shape)
    # warm-up: first calls pay one-off costs (both ways alike)
    sweep(engine, pairs[:1], cache, replace(exhaustive, sweeps=("resid",)))
    sweep(engine, pairs[:1], cache, screen, attributor)

    t_exh, exh_rows = sweep(engine, pairs, cache, exhaustive)
    runs_exh = count_runs(pairs, exhaustive, shape.n_layers, shape.n_heads)
    t_atp, atp_rows = sweep(engine, pairs, cache, screen, attributor)
    t0 = time.perf_counter()
    attributor.estimate(pairs, ("resid", "attn_out", "mlp_out", "head"))
    t_est = time.perf_counter() - t0
    verified = [r for r in atp_rows if r["verify"] is not None]
    t_gd, gd_rows = sweep(engine, pairs, cache, replace(screen, atp_correction="graddrop"), attributor)
    screens = [("by |estimate|" + (" with the QK fix" if qk else ""), atp_rows, t_atp),
               ("by GradDrop" + (" with the QK fix" if qk else ""), gd_rows, t_gd)]
    if qk:  # the same screen, q and k estimated by plain AtP (linearised through the softmax)
        t_plain, plain_rows = sweep(engine, pairs, cache, replace(screen, atp_qk_fix=False), attributor)
        screens.append(("by |estimate| without the QK fix (plain AtP)", plain_rows, t_plain))

    exact = {key(r): r for r in exh_rows}
    diff = sorted(abs(r["effect"] - exact[key(r)]["effect"]) for r in verified)
    print(f"activation cache (both ways need it): {t_cache:.1f} s")
    print(f"exhaustive exact sweep: {runs_exh} patched runs ({runs_exh / len(pairs):.0f} per pair): {t_exh:.1f} s "
          f"({runs_exh / t_exh:.1f} runs/s)")
    print(f"screen (K = {args.top}, R = {args.random}): {len(atp_rows)} sites estimated, {len(verified)} patched: "
          f"{t_atp:.1f} s (estimates {t_est:.1f} s, verification {t_atp - t_est:.1f} s)")
    print(f"  screen / exhaustive: {t_exh / t_atp:.1f}x faster (target >= 10)")
    same = sum(d == 0 for d in diff) / len(diff)
    print(f"  verified effects against the exhaustive sweep's ({str(engine.dtype).removeprefix('torch.')}): {same:.0%} "
          f"identical; |difference| median {diff[len(diff) // 2]:.1e}, 99th pct {diff[int(len(diff) * 0.99)]:.1e}, "
          f"max {diff[-1]:.1e} (headline metric). A run may start at another layer when its call groups requests "
          "otherwise, and a started run reads the bf16-rounded stream; in float32 they agree within 1e-5")
    kinds = row_shapes()
    for label, rows, t in screens:
        print(f"  screen {label}: {t:.1f} s, {t_exh / t:.1f}x faster")
        print_agreement(label, agreement_rows(pairs, rows + exh_rows, kinds))

    t0 = time.perf_counter()
    attributor.estimate(pairs, ("neuron",))
    t_neurons = time.perf_counter() - t0
    n_sites = sum(shape.n_layers * shape.d_mlp * len(p.corrupt_ids) for p in pairs)
    print(f"neuron screen: AtP estimates of {n_sites:,} neuron sites ({shape.n_layers} layers x {shape.d_mlp} neurons "
          f"x every position, {n_sites // len(pairs):,} per pair) in {t_neurons:.1f} s; patched one by one at the "
          f"exhaustive sweep's rate they would take about {n_sites / (runs_exh / t_exh) / 3600:.1f} hours "
          "(extrapolated, not run)")
    engine.close()


if __name__ == "__main__":
    main()
