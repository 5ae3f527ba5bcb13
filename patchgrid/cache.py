"""Clean (and corrupt) activations captured once per pair, cached as Arrow IPC files.

Layout of one cache data set, a folder named by its key under the cache root:

    manifest.json    what the key was made of, dtype, widths, pair order, the site keys of each
                     run, each file's size and sha256 (checked when the set is found); written last
    clean.arrow      one row per (pair, position); one column per site key (`resid.3`, `head.3`...),
                     each a fixed-size list of the site's width in the model's dtype (bfloat16
                     is stored as its uint16 bit pattern, since Arrow has no bfloat16)
    corrupt.arrow    the same for the corrupt runs: the sites a sweep patches corrupt into clean,
                     and the stream at every layer, which patched runs start from mid-stack
    noised.<s>.arrow causal tracing's noised run of sample s (the clean prompt, seeded noise on the
                     subject): its stream at every layer, where restored runs start
    logprobs.arrow   per pair: the clean run's log-probabilities at its last prompt position (every
                     token of the vocabulary, float32), which KL divergences are measured from
    baselines.arrow  per pair: the clean and corrupt runs on every metric (rows.BASELINE)

A pair's rows in a run's file are its request's "tree" (plan.tree_len): the prompt's positions,
then each answer of several tokens' inputs past the prompt, which every run of the pair scores;
patched runs that start mid-stack read their stream over all of them.

The folder is written under a temporary name and renamed when complete, so a crash never leaves
a folder that looks finished. Files are read memory-mapped: a pair's activations are tensors over
the mapped file, never copied per sweep.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import torch

from .effects import reading_columns
from .metrics import Reading, kl_divergence
from .plan import LOGPROBS, Noise, Request, stream_key, trace_seed
from .rows import BASELINE
from .sites import site_key

# 2: the manifest holds each file's size and sha256; 3: each run its own keys; 4: answers scored whole
# (rows per pair are the tree of the prompt and the answers), every metric in the baselines, the
# clean run's log-probabilities
CACHE_VERSION = 4
NOISED = "noised."  # run names noised.0, noised.1, ...: causal tracing's noised runs, one per sample

_ARROW = {torch.bfloat16: (pa.uint16(), np.uint16), torch.float16: (pa.float16(), np.float16),
          torch.float32: (pa.float32(), np.float32)}


@dataclass(frozen=True)
class CacheSpec:
    """What a study's sweeps need captured: `keys` from every run of `runs`, and from some runs
    more (`more`: (run, keys)). A run named noised.<s> is the clean prompt with causal tracing's
    noise of sample s, drawn with `noise` = (std, seed)."""

    keys: tuple[str, ...]  # site keys, e.g. resid.0 ... resid.29, embed
    runs: tuple[str, ...] = ("clean",)
    more: tuple[tuple[str, tuple[str, ...]], ...] = ()
    noise: tuple[float, int] | None = None

    def captured(self) -> dict[str, tuple[str, ...]]:
        """run -> the site keys captured from it; clean (the baseline) always runs."""
        out: dict[str, tuple[str, ...]] = {"clean": ()}
        for run in self.runs:
            out[run] = tuple(self.keys)
        for run, keys in self.more:
            out[run] = tuple(dict.fromkeys(out.get(run, ()) + tuple(keys)))
        return out

    def noised(self) -> bool:
        return any(run.startswith(NOISED) for run in self.captured())

    def covered_by(self, other: CacheSpec) -> bool:
        theirs = other.captured()
        if any(not set(keys) <= set(theirs.get(run, ())) or run not in theirs
               for run, keys in self.captured().items()):
            return False
        return not self.noised() or self.noise == other.noise

    def merge(self, other: CacheSpec) -> CacheSpec:
        if self.noise and other.noise and self.noise != other.noise:
            raise ValueError(f"two noise settings for the noised runs: {self.noise} and {other.noise}")
        mine, theirs = self.captured(), other.captured()
        runs = {run: tuple(dict.fromkeys(mine.get(run, ()) + theirs.get(run, ()))) for run in {**mine, **theirs}}
        return CacheSpec((), (), tuple(runs.items()), self.noise or other.noise)


def layer_keys(site: str, n_layers: int) -> tuple[str, ...]:
    return tuple(site_key(site, layer) for layer in range(n_layers))


def stream_keys(n_layers: int) -> tuple[str, ...]:
    """The stream entering each layer a patched run can start at (1 .. n_layers - 1)."""
    return tuple(stream_key(layer) for layer in range(1, n_layers))


def model_identity(folder: Path) -> dict:
    """Hashes of the weights and tokenizer files: a changed model misses the cache."""
    from .models import MANIFEST, weights_hash

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


class CacheError(ValueError):
    """The activation cache lacks what a sweep reads; the message names what is missing."""


class ActivationCache:
    """A complete cache data set, memory-mapped."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.manifest = json.loads((self.folder / "manifest.json").read_text())
        self.dtype = getattr(torch, self.manifest["dtype"])
        self.pair_ids: list[str] = self.manifest["pair_ids"]
        self._index = {pid: i for i, pid in enumerate(self.pair_ids)}
        self._keys: dict[str, list[str]] = self.manifest["captured"]
        self._tables = {run: _read_ipc(self.folder / f"{run}.arrow") for run in self._keys}
        self._rows = {}  # run -> pair index -> (batch, row0, n)
        self._batches = {run: t.to_batches() for run, t in self._tables.items()}
        for run, batches in self._batches.items():
            idx = {}
            for b, batch in enumerate(batches):
                pairs = batch.column("pair_index").to_numpy()
                firsts = np.flatnonzero(np.r_[True, pairs[1:] != pairs[:-1]])
                counts = np.diff(np.r_[firsts, len(pairs)])
                for row0, n in zip(firsts, counts):
                    idx[int(pairs[row0])] = (b, int(row0), int(n))
            self._rows[run] = idx
        base = _read_ipc(self.folder / "baselines.arrow").to_pylist()
        self.baselines = {row["pair_id"]: row for row in base}
        self._logprobs = _read_ipc(self.folder / "logprobs.arrow").column("logprobs").combine_chunks()

    @property
    def spec(self) -> CacheSpec:
        return _spec_of(self.manifest)

    @property
    def bytes_per_pair(self) -> float:
        return self.manifest["bytes"] / max(1, len(self.pair_ids))

    def captures(self, pair_id: str, run: str = "clean", keys=None) -> dict[str, torch.Tensor]:
        """{site key: [tokens, width]} for one pair, as views over the mapped file."""
        if run not in self._rows:
            raise CacheError(f"the activation cache {self.folder} holds no {run} run (it holds "
                             f"{', '.join(self._rows)}): build it with cache_spec() of the sweeps that read it")
        if pair_id not in self._index:
            raise CacheError(f"the activation cache {self.folder} holds no pair {pair_id!r}")
        missing = [k for k in keys or () if k not in self._keys[run]]
        if missing:
            raise CacheError(f"the activation cache {self.folder} holds no {missing[0]} of the {run} run: build it "
                             "with cache_spec() of the sweeps that read it")
        b, row0, n = self._rows[run][self._index[pair_id]]
        batch = self._batches[run][b]
        out = {}
        for key in keys or self._keys[run]:
            out[key] = _tensor(batch.column(key), row0, n, self.manifest["widths"][key], self.dtype)
        return out

    def logprobs(self, pair_id: str) -> torch.Tensor:
        """The clean run's log-probabilities at its last prompt position [vocab], float32."""
        i = self._index[pair_id]
        return _tensor(self._logprobs, i, 1, self._logprobs.type.list_size, torch.float32)[0]


def _spec_of(manifest: dict) -> CacheSpec:
    noise = manifest.get("noise")
    return CacheSpec((), (), tuple((run, tuple(keys)) for run, keys in manifest["captured"].items()),
                     None if noise is None else tuple(noise))


class ActivationStore(Protocol):
    """What sweeps read: each pair's captured activations per run, and its baselines."""

    baselines: dict[str, dict]  # pair_id -> a rows.BASELINE row
    spec: CacheSpec  # what it holds

    def captures(self, pair_id: str, run: str = "clean", keys=None) -> dict[str, torch.Tensor]: ...

    def logprobs(self, pair_id: str) -> torch.Tensor: ...


def run_request(pair, run: str, spec: CacheSpec, capture=()) -> Request:
    """The unpatched run `run` of `pair`: its clean or corrupt prompt, or the clean prompt noised,
    scoring both answers."""
    # the baselines' KL divergence is measured from the clean run's log-probabilities
    common = dict(answers=pair.answers, continuations=pair.continuations, capture=capture,
                  logprobs=run in ("clean", "corrupt"))
    if run == "corrupt":
        return Request(tokens=pair.corrupt_ids, **common)
    noise = ()
    if run.startswith(NOISED):
        std, seed = spec.noise
        noise = (Noise(pair.subject_positions, std, trace_seed(seed, pair.pair_id, int(run[len(NOISED):]))),)
    return Request(tokens=pair.clean_ids, noise=noise, **common)


def capture_runs(engine, pairs, spec: CacheSpec):
    """One engine call: every run `spec` names for each pair (clean and corrupt always: they are
    the baselines), capturing its sites.

    Returns ({run: results in pair order}, baseline rows).
    """
    captured = spec.captured()  # clean first, then corrupt: the order the baselines were always run in
    captured = {"clean": captured.pop("clean"), "corrupt": captured.pop("corrupt", ()), **captured}
    if spec.noised() and spec.noise is None:
        raise ValueError("the cache spec names noised runs but no noise (std, seed)")
    reqs = [run_request(p, run, spec, keys) for p in pairs for run, keys in captured.items()]
    results = engine.run(reqs)
    k = len(captured)
    by_run = {run: results[j::k] for j, run in enumerate(captured)}
    baselines = [baseline_row(p.pair_id, c, x) for p, c, x in zip(pairs, by_run["clean"], by_run["corrupt"])]
    return by_run, baselines


def baseline_row(pair_id: str, clean, corrupt) -> dict:
    """The clean and corrupt runs on every metric (the clean run is its own KL reference: 0)."""
    kl = float(kl_divergence(clean.logprobs, corrupt.logprobs))
    return {"pair_id": pair_id, **reading_columns("clean", Reading.of(clean, kl=0.0)),
            **reading_columns("corrupt", Reading.of(corrupt, kl=kl))}


class MemoryStore:
    """Captured activations held in memory: one pair patched at the command line needs no cache."""

    def __init__(self, engine, pairs, spec: CacheSpec):
        by_run, baselines = capture_runs(engine, pairs, spec)
        self.spec = spec
        self._captures = {(p.pair_id, run): r.captures for run, results in by_run.items()
                          for p, r in zip(pairs, results)}
        self.baselines = {b["pair_id"]: b for b in baselines}
        self._logprobs = {p.pair_id: r.logprobs for p, r in zip(pairs, by_run["clean"])}

    def captures(self, pair_id: str, run: str = "clean", keys=None) -> dict[str, torch.Tensor]:
        caps = self._captures[(pair_id, run)]
        return dict(caps) if keys is None else {k: caps[k] for k in keys}

    def logprobs(self, pair_id: str) -> torch.Tensor:
        return self._logprobs[pair_id]


def load_or_build(engine, pairs, spec: CacheSpec, root: Path, *, batch_pairs: int = 64,
                  log=print) -> tuple[ActivationCache, bool]:
    """Find a complete cache data set covering `spec` for these pairs and model, or build one.

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
    _build(engine, pairs, spec, ident, folder, batch_pairs, log)
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
        if {k: m.get(k) for k in ident} == ident and spec.covered_by(_spec_of(m)):
            problem = damage(manifest.parent)
            if problem is None:
                return manifest.parent
            log(f"activation cache {manifest.parent} is damaged ({problem}): discarded, it will be rebuilt")
            shutil.rmtree(manifest.parent, ignore_errors=True)
    return None


def damage(folder: str | Path) -> str | None:
    """What is wrong with a cache data set, checked against the sizes and sha256 sums written with
    it; None when it is sound."""
    from .models import sha256_file

    folder = Path(folder)
    try:
        files = json.loads((folder / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable manifest"
    for name, (size, digest) in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written"
        if sha256_file(path) != digest:
            return f"{name} does not match its sha256"
    return None


def _build(engine, pairs, spec: CacheSpec, ident: dict, folder: Path, batch_pairs: int, log) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        captured = spec.captured()
        widths = {k: engine.shape.width(k.split(".")[0]) for keys in captured.values() for k in keys}
        dtype_arrow, _ = _ARROW[engine.dtype]
        schemas, writers = {}, {}
        for run, keys in captured.items():
            fields = [pa.field("pair_index", pa.int32()), pa.field("position", pa.int32())]
            fields += [pa.field(k, pa.list_(dtype_arrow, widths[k])) for k in keys]
            schemas[run] = pa.schema(fields, metadata={"dtype": str(engine.dtype)})
            writers[run] = pa.ipc.new_file(str(tmp / f"{run}.arrow"), schemas[run])
        baselines, logprobs = [], []
        try:
            for start in range(0, len(pairs), batch_pairs):
                chunk = pairs[start:start + batch_pairs]
                by_run, base = capture_runs(engine, chunk, spec)
                for run, keys in captured.items():
                    writers[run].write_batch(_batch(schemas[run], keys, start, chunk, by_run[run], engine.dtype))
                baselines += base
                logprobs += [r.logprobs for r in by_run["clean"]]
                log(f"cached {', '.join(captured)} runs of {min(start + batch_pairs, len(pairs))}/{len(pairs)} pairs")
        finally:
            for w in writers.values():
                w.close()
        with pa.ipc.new_file(str(tmp / "baselines.arrow"), BASELINE.schema) as w:
            w.write_table(BASELINE.table(baselines))
        vocab = engine.shape.vocab_size
        lp = torch.stack(logprobs).float().numpy().reshape(-1) if logprobs else np.zeros(0, np.float32)
        table = pa.table({"pair_index": pa.array(np.arange(len(logprobs), dtype=np.int32)),
                          LOGPROBS: pa.FixedSizeListArray.from_arrays(pa.array(lp), vocab)})
        with pa.ipc.new_file(str(tmp / "logprobs.arrow"), table.schema) as w:
            w.write_table(table)
        from .models import sha256_file

        files = {f.name: (f.stat().st_size, sha256_file(f)) for f in sorted(tmp.iterdir())}
        manifest = {**ident, "captured": {run: list(keys) for run, keys in captured.items()},
                    "noise": list(spec.noise) if spec.noised() else None, "widths": widths,
                    "pair_ids": [p.pair_id for p in pairs], "bytes": sum(size for size, _ in files.values()),
                    "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        if folder.exists():  # an earlier, incomplete or superseded copy under the same key
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _batch(schema, keys, start, chunk, results, dtype) -> pa.RecordBatch:
    # a pair's rows: its prompt's positions, then its answers' inputs (plan.tree_len)
    rows = [len(r.captures[keys[0]]) if keys else len(p.clean_ids) for p, r in zip(chunk, results)]
    pair_index = np.concatenate([np.full(n, start + i, np.int32) for i, n in enumerate(rows)])
    position = np.concatenate([np.arange(n, dtype=np.int32) for n in rows])
    cols = [pa.array(pair_index), pa.array(position)]
    _, np_dtype = _ARROW[dtype]
    for key in keys:
        t = torch.cat([r.captures[key] for r in results]).to(dtype).contiguous()
        raw = t.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16 else t.numpy()
        cols.append(pa.FixedSizeListArray.from_arrays(pa.array(raw.reshape(-1).astype(np_dtype, copy=False)),
                                                      t.shape[1]))
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def _read_ipc(path: Path) -> pa.Table:
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def _tensor(column: pa.FixedSizeListArray, row0: int, n: int, width: int, dtype) -> torch.Tensor:
    values = column.values
    _, np_dtype = _ARROW[dtype]
    item = np.dtype(np_dtype).itemsize
    buf = values.buffers()[1]
    start = (values.offset + (column.offset + row0) * width) * item
    arr = np.frombuffer(buf, dtype=np_dtype, count=n * width, offset=start).reshape(n, width)
    with warnings.catch_warnings():
        # The mapped file is read-only; nothing writes to these tensors (engines copy what they send).
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
