"""How long a fully cached rerun of a study takes against a model folder of a few GB, with the
weights' fingerprint record and the cache's recorded stats, and without them (every weight file and
every cache file hashed again, as when no record exists).

Builds a llama-family model folder of seeded random float32 weights (tiny-llama's tokenizer, wide
layers: about 2.4 GB in 1 GB safetensors shards; no patchgrid-model.json, so its weights are hashed
as any user's folder), runs a small study on it once (2 pairs, the resid sweep), then, in the same
process, times the identical rerun (everything cached), and the same rerun again with the record and
the stats deleted. The synthetic model is deleted at the end.

    .venv/bin/python benchmarks/cached_rerun.py [--gb 2.4] [--backend vllm] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, INTERMEDIATE, HEADS = 2048, 5504, 16


def build_model(folder: Path, gb: float) -> int:
    """A llama model folder of about `gb` GB of float32 weights; returns its layer count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from patchgrid.model.models import prepare

    tiny = prepare("tiny-llama")
    folder.mkdir(parents=True)
    for f in tiny.iterdir():  # the tokenizer and generation config; not the weights nor patchgrid's manifest
        if f.is_file() and f.suffix == ".json" and f.name not in ("config.json", "patchgrid-model.json"):
            shutil.copy(f, folder / f.name)
    base = json.loads((tiny / "config.json").read_text())
    per_layer = 4 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)
    layers = max(1, round(gb * 1e9 / per_layer))
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=HIDDEN // HEADS,
                         max_position_embeddings=1024, tie_word_embeddings=False, vocab_size=base["vocab_size"],
                         bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    model.config.dtype = "float32"
    model.save_pretrained(folder, max_shard_size="1GB")
    return layers


def forget_records(model: Path, work: Path) -> None:
    """Back to what was there before records: no weights record, no stats in the cache manifests."""
    from patchgrid.model.models import WEIGHTS_RECORD

    (model / WEIGHTS_RECORD).unlink(missing_ok=True)  # the folder is writable: the only record
    for manifest in work.glob("cache/*/manifest.json"):
        m = json.loads(manifest.read_text())
        m.pop("stats", None)
        manifest.write_text(json.dumps(m))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.4, help="size of the synthetic weights")
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--repeats", type=int, default=3, help="timed reruns each way (the median is printed)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="patchgrid-cached-rerun-"))
    # a Prefect of its own: a temporary database and results folder
    os.environ.update(PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_LOCAL_STORAGE_PATH=str(tmp / "results"),
                      PREFECT_LOGGING_LEVEL="WARNING", PREFECT_SERVER_ANALYTICS_ENABLED="false",
                      PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")  # a busy machine starts it slowly
    os.environ.pop("PREFECT_API_URL", None)
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, tmp: Path):
    from patchgrid.cache import model_identity
    from patchgrid.flows.study import study
    from patchgrid.pipeline.spec import StudySpec
    from patchgrid.runtime.machine import machine
    from tests.support.pairs import DATA

    model, work = tmp / "model", tmp / "work"
    build_s, layers = timed(lambda: build_model(model, args.gb))
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    spec = StudySpec.of(model=str(model), pairs=str(DATA), sweeps="resid", limit=2, shard_size=2,
                        require_known=False, backend=args.backend, warehouse=str(tmp / "w.duckdb"),
                        workdir=str(work))
    first_s, run_id = timed(lambda: study(spec))

    def rerun():
        seconds, again = timed(lambda: study(spec))
        assert again == run_id, (again, run_id)
        return seconds

    cached = [rerun() for _ in range(args.repeats)]
    ident_cached, _ = timed(lambda: model_identity(model))
    full = []
    for _ in range(args.repeats):
        forget_records(model, work)
        full.append(rerun())
    forget_records(model, work)
    ident_full, _ = timed(lambda: model_identity(model))
    cached_s, full_s = statistics.median(cached), statistics.median(full)
    print(f"{machine()}; 1-minute load average {os.getloadavg()[0]:.2f} at the end (other work on these cores "
          "slows every figure)")
    print(f"model: llama, {layers} layers x {HIDDEN} wide, float32, {weights / 1e9:.2f} GB in "
          f"{len(list(model.glob('*.safetensors')))} safetensors files (built in {build_s:.0f} s); study: 2 pairs, "
          f"resid, backend {args.backend}, run {run_id}")
    print(f"first run (nothing cached)                  {first_s:7.1f} s")
    print(f"rerun, everything cached, records kept      {cached_s:7.2f} s  (median of {args.repeats}: "
          f"{' '.join(f'{s:.2f}' for s in cached)}; target < 10 s)")
    print(f"rerun, records deleted (every file hashed)  {full_s:7.2f} s  (median of {args.repeats}: "
          f"{' '.join(f'{s:.2f}' for s in full)})")
    print(f"full hash / recorded = {full_s / cached_s:.2f}x; the weights' identity alone: {ident_cached * 1e3:.1f} ms "
          f"recorded, {ident_full:.2f} s hashed ({weights / 1e9 / ident_full:.2f} GB/s, files in the page cache)")


if __name__ == "__main__":
    main()
