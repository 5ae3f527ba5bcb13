"""How long a resumed study takes against a full run.

Runs one study start to finish; runs it again in a fresh folder and kills it (SIGKILL, the
whole process group) once half its shards are written; then reruns it, which resumes. Prints the
three wall times. The same machine and process start-up costs are in all three.

    .venv/bin/python benchmarks/resume_time.py [--model smollm2-135m] [--limit 8] [--shard-size 2]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    from tests.support.pairs import DATA
    from tests.support.processes import env_for, kill9, start, wait_for

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=2)
    parser.add_argument("--sweeps", default="resid,attn_out,mlp_out,heads")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    env = env_for(tmp)

    def cmd(name):
        return [sys.executable, "-m", "patchgrid", "study", "--model", args.model, "--pairs", str(DATA), "--limit",
                str(args.limit), "--shard-size", str(args.shard_size), "--sweeps", args.sweeps, "--warehouse",
                str(tmp / f"{name}.duckdb"), "--workdir", str(tmp / name)]

    t0 = time.monotonic()
    subprocess.run(cmd("full"), env=env, cwd=tmp, check=True, capture_output=True)
    full = time.monotonic() - t0

    n_shards = -(-args.limit // args.shard_size)
    t0 = time.monotonic()
    proc = start(cmd("killed"), env, tmp)
    wait_for(lambda: len(list((tmp / "killed").glob("runs/*/effects/*.parquet"))) >= n_shards // 2, 3600, proc,
             "half the shards")
    kill9(proc)
    killed = time.monotonic() - t0
    t0 = time.monotonic()
    subprocess.run(cmd("killed"), env=env, cwd=tmp, check=True, capture_output=True)
    resume = time.monotonic() - t0
    from patchgrid.runtime.machine import machine

    print(machine())
    print(f"{args.model}, {args.limit} pairs in {n_shards} shards, sweeps {args.sweeps}")
    print(f"full run                          {full:7.1f} s")
    print(f"run killed after {n_shards // 2} of {n_shards} shards    {killed:7.1f} s")
    print(f"resume to completion              {resume:7.1f} s  ({resume / full:.2f} of a full run)")


if __name__ == "__main__":
    main()
