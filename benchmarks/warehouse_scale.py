"""Load 10 million synthetic effect rows into a fresh warehouse and query effect_summary for one run.

Prints rows loaded per second (target >= 1,000,000) and the query's seconds (target <= 2). The
rows have a study's shape: 2,000 pairs x 30 layers x 8 positions x (resid denoise + noise,
attn_out, mlp_out) ~ 1.9 M rows per run, over several runs. Then, with the warehouse full:
- the same query while another process loads runs without pause (ratio to the idle query);
- 4 loader processes at once, each loading its own run (rows/s over all four, and the ratio to
  one loader at a time).

    .venv/bin/python benchmarks/warehouse_scale.py [--rows 10000000] [--runs 5]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROLES = np.array(["before_subject", "before_subject", "subject_first", "subject_last", "after_subject",
                  "further", "further", "last"])
SITES = [("resid", "resid", "denoise"), ("resid", "resid", "noise"), ("attn_out", "attn_out", "denoise"),
         ("mlp_out", "mlp_out", "denoise")]
# Every metric's clean and corrupt value (patchgrid/metrics.py): the clean run knows its answer.
CLEAN = {"logit_diff": 3.0, "logprob_diff": 3.0, "logp_clean": -0.5, "logp_corrupt": -3.5, "p": 0.6, "kl": 0.0,
         "rank": 0.0}
CORRUPT = {"logit_diff": -2.0, "logprob_diff": -2.0, "logp_clean": -3.5, "logp_corrupt": -0.5, "p": 0.03, "kl": 2.0,
           "rank": 6.0}


def synthetic_run(n_rows: int, seed: int) -> pa.Table:
    from patchgrid.metrics import METRICS
    from patchgrid.rows.effects import SCHEMA

    assert set(CLEAN) == set(CORRUPT) == set(METRICS)
    rng = np.random.default_rng(seed)
    i = np.arange(n_rows)
    pos = i % 8
    layer = (i // 8) % 30
    site = (i // 240) % len(SITES)
    pair = i // (240 * len(SITES))
    recovery = rng.normal(0.3, 0.4, n_rows).astype(np.float32)
    cols = {
        "pair_id": pa.array(np.char.add("p", pair.astype(str))),
        "relation": pa.array(np.array(["capital", "continent", "currency", "language"])[pair % 4]),
        "sweep": pa.array(np.array([s[0] for s in SITES])[site]),
        "site": pa.array(np.array([s[1] for s in SITES])[site]),
        "direction": pa.array(np.array([s[2] for s in SITES])[site]),
        "layer": pa.array(layer.astype(np.int32)),
        "position": pa.array(pos.astype(np.int32)),
        "position_role": pa.array(ROLES[pos]),
        "head": pa.nulls(n_rows, pa.int32()),
        "neuron": pa.nulls(n_rows, pa.int32()),
        "window": pa.nulls(n_rows, pa.int32()),
        "sender": pa.nulls(n_rows, pa.string()),  # no path-patching rows
        "receiver": pa.nulls(n_rows, pa.string()),
        "blocked": pa.nulls(n_rows, pa.string()),  # no knockout rows
        "metric": pa.array(np.full(n_rows, "logit_diff")),
        "effect": pa.array(recovery * np.float32(CLEAN["logit_diff"] - CORRUPT["logit_diff"])),
        "recovery": pa.array(recovery),
        "estimate": pa.nulls(n_rows, pa.float32()),  # exact patching only: no atp rows
        "estimate_graddrop": pa.nulls(n_rows, pa.float32()),
        "verify": pa.nulls(n_rows, pa.string()),
        "circuit_size": pa.nulls(n_rows, pa.float32()),  # no circuit rows
        "circuit_edges": pa.nulls(n_rows, pa.int32()),
        "circuit_rank": pa.nulls(n_rows, pa.int32()),
        "ablation": pa.nulls(n_rows, pa.string()),  # patching
    }
    # every metric of a study's rows: each recovers its own share, around the headline's
    for name in CLEAN:
        clean, corrupt = np.float32(CLEAN[name]), np.float32(CORRUPT[name])
        share = recovery if name == "logit_diff" else recovery + rng.normal(0, 0.1, n_rows).astype(np.float32)
        cols[f"patched_{name}"] = pa.array(corrupt + share * (clean - corrupt))
        cols[f"clean_{name}"] = pa.array(np.full(n_rows, clean))
        cols[f"corrupt_{name}"] = pa.array(np.full(n_rows, corrupt))
    # one-token answers: one log-probability per answer and run
    for prefix in ("patched", "clean", "corrupt"):
        for what in ("logp_clean", "logp_corrupt"):
            values = cols[f"{prefix}_{what}"].to_numpy(zero_copy_only=False)
            cols[f"{prefix}_{what}_tokens"] = pa.ListArray.from_arrays(np.arange(n_rows + 1, dtype=np.int32),
                                                                       pa.array(values))
    return pa.table(cols, schema=SCHEMA)


def pairs_for(table: pa.Table):
    from patchgrid.pairs import to_table

    ids = sorted(set(table.column("pair_id").to_pylist()))
    return to_table([{"pair_id": p, "relation": "capital", "status": "accepted", "roles": list(ROLES),
                      "subject_start": 2, "subject_end": 4} for p in ids])


def _load(args) -> int:
    """One loader process: record the run, then publish its load."""
    wh, run_id, effects, pairs_file = args
    from patchgrid.warehouse.loader import load_run, start_run

    start_run(wh, {"run_id": run_id, "model": "synthetic"})
    return load_run(wh, run_id, pq.read_table(pairs_file), [], [effects])["effects"]


def _warm(folder: str) -> int:
    """A small load into a scratch warehouse, so that a pool worker's timed load does not include
    its imports (a study's loader has them already); the pause makes each worker take one."""
    import os

    scratch = Path(folder) / f"warm-{os.getpid()}"
    scratch.mkdir(exist_ok=True)
    table = synthetic_run(1000, 0)
    pq.write_table(table, scratch / "e.parquet")
    pq.write_table(pairs_for(table), scratch / "p.parquet")
    _load((str(scratch / "w.duckdb"), "warm", str(scratch / "e.parquet"), str(scratch / "p.parquet")))
    time.sleep(1.0)
    return os.getpid()


def _load_forever(args) -> None:
    wh, effects, pairs_file, stop = args
    k = 0
    while not Path(stop).exists():
        _load((wh, f"run-busy-{k % 2}", effects, pairs_file))
        k += 1


def _query_times(wh, run_id: str, n: int, view: str = "effect_summary") -> list[float]:
    from patchgrid.warehouse.loader import query

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        query(wh, f"SELECT * FROM {view} WHERE run_id = ?", [run_id])
        times.append(time.perf_counter() - t0)
    return sorted(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    from patchgrid.warehouse.loader import load_run, query, start_run

    work = Path(tempfile.mkdtemp())
    wh = work / "scale.duckdb"
    per_run = args.rows // args.runs
    files, pairs = [], []
    t0 = time.perf_counter()
    for r in range(args.runs):
        table = synthetic_run(per_run, r)
        f = work / f"run{r}.parquet"
        pq.write_table(table, f)
        files.append(f)
        pairs.append(pairs_for(table))
    print(f"made {per_run * args.runs:,} synthetic rows in {time.perf_counter() - t0:.1f} s (not timed below)")

    loaded = 0
    t0 = time.perf_counter()
    for r in range(args.runs):
        start_run(wh, {"run_id": f"run-{r}", "model": "synthetic"})
        loaded += load_run(wh, f"run-{r}", pairs[r], [], [files[r]])["effects"]
    t_load = time.perf_counter() - t0

    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        _, rows = query(wh, "SELECT * FROM effect_summary WHERE run_id = ?", ["run-2"])
        times.append(time.perf_counter() - t0)
    t_query = sorted(times)[1]
    print(f"loaded {loaded:,} effect rows in {t_load:.2f} s: {loaded / t_load:,.0f} rows/s (target >= 1,000,000)")
    print(f"effect_summary for one run ({per_run:,} rows, {len(rows):,} summary rows): {t_query:.2f} s median of 3 "
          f"(target <= 2)")
    facts = _query_times(wh, "run-2", 3, view="effect_summary_facts")
    print(f"effect_summary_facts (the fact-clustered intervals) for the same run: {facts[1]:.2f} s median of 3")
    data = sum(f.stat().st_size for f in wh.with_name(wh.stem + ".data").rglob("*") if f.is_file())
    print(f"warehouse: {data / 1e6:.0f} MB of Parquet files, {wh.stat().st_size / 1e6:.1f} MB dashboard file (views)")

    # query latency while another run loads, again and again, from another process
    pairs_file = work / "pairs0.parquet"
    pq.write_table(pairs[0], pairs_file)
    idle = _query_times(wh, "run-2", 5)
    stop = work / "stop"
    ctx = mp.get_context("spawn")
    loader = ctx.Process(target=_load_forever, args=((str(wh), str(files[0]), str(pairs_file), str(stop)),))
    loader.start()
    time.sleep(2.0)  # the loader has started (spawn imports) and is loading
    busy = _query_times(wh, "run-2", 5)
    stop.write_text("")
    loader.join()
    print(f"effect_summary for one run while another run loads: median {busy[2]:.2f} s, max {busy[-1]:.2f} s "
          f"(idle median {idle[2]:.2f} s; ratio {busy[2] / idle[2]:.2f}x)")

    # 4 loaders at once, each its own run, against one at a time
    t0 = time.perf_counter()
    one = _load((str(wh), "run-solo", str(files[0]), str(pairs_file)))
    t_one = time.perf_counter() - t0
    with ctx.Pool(4) as pool:
        assert len(set(pool.map(_warm, [str(work)] * 4, chunksize=1))) == 4
        t0 = time.perf_counter()
        many = sum(pool.map(_load, [(str(wh), f"run-par-{k}", str(files[k % len(files)]), str(pairs_file))
                                    for k in range(4)]))
        t_many = time.perf_counter() - t0
    print(f"4 concurrent loaders: {many:,} rows in {t_many:.2f} s: {many / t_many:,.0f} rows/s "
          f"(one loader: {one / t_one:,.0f} rows/s; ratio {(many / t_many) / (one / t_one):.2f}x)")
    from patchgrid.runtime.machine import machine

    print(machine())


if __name__ == "__main__":
    main()
