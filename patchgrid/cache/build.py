"""`load_or_build`: find a sound cache data set covering a spec for these pairs and model, or
build one: written under a temporary name, renamed when complete, its manifest written last."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa

from ..model.models import MANIFEST, settled_sha256, weights_hash
from ..rows.shapes import BASELINE
from ..runtime.progress import Progress
from .arrow import logprobs_table, record_batch, run_schema, write_table
from .captures import CacheSpec
from .damage import damage
from .runs import capture_runs
from .store import ActivationCache

# 2: the manifest holds each file's size and sha256; 3: each run its own keys; 4: answers scored whole
# (rows per pair are the tree of the prompt and the answers), every metric in the baselines, the
# clean run's log-probabilities
CACHE_VERSION = 4


def model_identity(folder: Path) -> dict:
    """Hashes of the weights and tokenizer files: a changed model misses the cache."""
    manifest = folder / MANIFEST
    weights = None
    if manifest.is_file():
        weights = json.loads(manifest.read_text()).get("weights_sha256")
    weights = weights or weights_hash(folder)
    tok = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            tok.update(name.encode())
            tok.update((folder / name).read_bytes())
    return {"weights_sha256": weights, "tokenizer_sha256": tok.hexdigest()}


def pairs_identity(pairs) -> str:
    h = hashlib.sha256()
    for p in pairs:
        h.update(json.dumps([p.pair_id, list(p.clean_ids), list(p.corrupt_ids), list(p.clean_answer_ids),
                             list(p.corrupt_answer_ids)]).encode())
    return h.hexdigest()


def load_or_build(engine, pairs, spec: CacheSpec, root: Path, *, batch_pairs: int = 64,
                  log=print, progress: Progress | None = None) -> tuple[ActivationCache, bool]:
    """Find a complete cache data set covering `spec` for these pairs and model, or build one;
    `progress` is told the pairs captured so far, after each engine call.

    Returns (cache, built): built is False when the clean forwards were found, not run.
    """
    root = Path(root)
    ident = {"version": CACHE_VERSION, **model_identity(engine.folder), "pairs_sha256": pairs_identity(pairs),
             "dtype": str(engine.dtype).removeprefix("torch.")}
    found = _find(root, ident, spec, log)
    if found is not None:
        return ActivationCache(found), False
    captured = {run: sorted(keys) for run, keys in spec.captured().items()}
    key = hashlib.sha256(json.dumps({**ident, "captured": captured, "noise": spec.noise if spec.noised() else None},
                                    sort_keys=True).encode()).hexdigest()[:24]
    folder = root / key
    _build(engine, pairs, spec, ident, folder, batch_pairs, log, progress)
    return ActivationCache(folder), True


def _find(root: Path, ident: dict, spec: CacheSpec, log) -> Path | None:
    """A sound data set for `ident` covering `spec`; a damaged one is logged and discarded."""
    if not root.is_dir():
        return None
    for manifest in sorted(root.glob("*/manifest.json")):
        try:
            m = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        if {k: m.get(k) for k in ident} == ident and spec.covered_by(CacheSpec.of_manifest(m)):
            problem = damage(manifest.parent)
            if problem is None:
                return manifest.parent
            log(f"activation cache {manifest.parent} is damaged ({problem}): discarded, it will be rebuilt")
            shutil.rmtree(manifest.parent, ignore_errors=True)
    return None


def _build(engine, pairs, spec: CacheSpec, ident: dict, folder: Path, batch_pairs: int, log, progress) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        captured = spec.captured()
        widths = {k: engine.shape.width(k.split(".")[0]) for keys in captured.values() for k in keys}
        baselines, logprobs = _write_runs(engine, pairs, spec, captured, widths, tmp, batch_pairs, log, progress)
        with pa.ipc.new_file(str(tmp / "baselines.arrow"), BASELINE.schema) as w:
            w.write_table(BASELINE.table(baselines))
        write_table(tmp / "logprobs.arrow", logprobs_table(logprobs, engine.shape.vocab_size))
        hashed = {f.name: settled_sha256(f) for f in sorted(tmp.iterdir())}
        files = {name: ((tmp / name).stat().st_size, digest) for name, (digest, _) in hashed.items()}
        manifest = {**ident, "captured": {run: list(keys) for run, keys in captured.items()},
                    "noise": list(spec.noise) if spec.noised() else None, "widths": widths,
                    "pair_ids": [p.pair_id for p in pairs], "bytes": sum(size for size, _ in files.values()),
                    "files": files, "stats": {name: stat for name, (_, stat) in hashed.items() if stat}}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        if folder.exists():  # an earlier, incomplete or superseded copy under the same key
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_runs(engine, pairs, spec: CacheSpec, captured, widths, tmp: Path, batch_pairs: int, log, progress):
    """Every run's file in `tmp`, `batch_pairs` pairs per engine call; returns (the baseline rows,
    the clean runs' log-probabilities), in pair order."""
    schemas, writers = {}, {}
    for run, keys in captured.items():
        schemas[run] = run_schema(keys, widths, engine.dtype)
        writers[run] = pa.ipc.new_file(str(tmp / f"{run}.arrow"), schemas[run])
    baselines, logprobs = [], []
    progress = progress or (lambda done, total: None)
    progress(0, len(pairs))
    try:
        for start in range(0, len(pairs), batch_pairs):
            chunk = pairs[start:start + batch_pairs]
            by_run, base = capture_runs(engine, chunk, spec)
            for run, keys in captured.items():
                writers[run].write_batch(record_batch(schemas[run], keys, start, chunk, by_run[run], engine.dtype))
            baselines += base
            logprobs += [r.logprobs for r in by_run["clean"]]
            log(f"cached {', '.join(captured)} runs of {min(start + batch_pairs, len(pairs))}/{len(pairs)} pairs")
            progress(min(start + batch_pairs, len(pairs)), len(pairs))
    finally:
        for w in writers.values():
            w.close()
    return baselines, logprobs
