"""The stores sweeps read each pair's captured activations and baselines from: a cache data set
on disk, memory-mapped (`ActivationCache`), or runs held in memory (`MemoryStore`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .arrow import read_ipc, tensor_rows

if TYPE_CHECKING:  # imported where it is used: the light commands import the cache's package and need no torch
    import torch
from .captures import CacheSpec
from .runs import capture_runs


class CacheError(ValueError):
    """The activation cache lacks what a sweep reads; the message names what is missing."""


class ActivationCache:
    """A complete cache data set, memory-mapped."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        import torch

        self.manifest = json.loads((self.folder / "manifest.json").read_text())
        self.dtype = getattr(torch, self.manifest["dtype"])
        self.pair_ids: list[str] = self.manifest["pair_ids"]
        self._index = {pid: i for i, pid in enumerate(self.pair_ids)}
        self._keys: dict[str, list[str]] = self.manifest["captured"]
        self._tables = {run: read_ipc(self.folder / f"{run}.arrow") for run in self._keys}
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
        base = read_ipc(self.folder / "baselines.arrow").to_pylist()
        self.baselines = {row["pair_id"]: row for row in base}
        self._logprobs = read_ipc(self.folder / "logprobs.arrow").column("logprobs").combine_chunks()

    @property
    def spec(self) -> CacheSpec:
        return CacheSpec.of_manifest(self.manifest)

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
            out[key] = tensor_rows(batch.column(key), row0, n, self.manifest["widths"][key], self.dtype)
        return out

    def logprobs(self, pair_id: str) -> torch.Tensor:
        """The clean run's log-probabilities at its last prompt position [vocab], float32."""
        import torch

        i = self._index[pair_id]
        return tensor_rows(self._logprobs, i, 1, self._logprobs.type.list_size, torch.float32)[0]



class ActivationStore(Protocol):
    """What sweeps read: each pair's captured activations per run, and its baselines."""

    baselines: dict[str, dict]  # pair_id -> a rows.BASELINE row
    spec: CacheSpec  # what it holds

    def captures(self, pair_id: str, run: str = "clean", keys=None) -> dict[str, torch.Tensor]: ...

    def logprobs(self, pair_id: str) -> torch.Tensor: ...


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
