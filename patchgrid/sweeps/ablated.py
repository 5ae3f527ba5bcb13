"""The values a patch takes under `ablation` mean or zero (sweeps.config; the source names are
sweeps.base.source_name's): zeros, or the mean over the run's pairs of a cached run's values at each
position role (a pair's position takes the mean of its role). The mean is over the pairs of this
run_sweeps call: a study sharded over several workers takes each shard's own mean (docs/methods.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..sites import parse_key

if TYPE_CHECKING:  # torch is imported where it is used: the light commands import the sweeps and need no torch
    import torch


class AblatedSources:
    def __init__(self, shape, pairs, store):
        self.shape, self.pairs, self.store = shape, pairs, store
        self.means: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # run -> key -> role -> [width]

    def get(self, name: str, keys) -> dict | None:
        """The values `name` stands for, at `keys`; None: a name of a run's own values."""
        index, _, run = name.partition(":")
        if "~" not in run:
            return None
        import torch

        run, _, how = run.partition("~")
        pair = self.pairs[int(index)]
        n = len(pair.clean_ids)
        if how == "zero":
            return {k: torch.zeros(n, self.shape.width(parse_key(k)[0])) for k in keys}
        if how != "mean":
            raise ValueError(f"source {name!r}: unknown ablation {how!r}")
        means = self._means(run)
        missing = [k for k in keys if k not in means]
        if missing:
            raise ValueError(f"source {name!r}: the cache's {run} run holds no {missing[0]} to take the mean of")
        return {k: torch.stack([means[k][role] for role in pair.roles[:n]]) for k in keys}

    def _means(self, run: str) -> dict[str, dict[str, torch.Tensor]]:
        if run not in self.means:
            sums: dict[str, dict[str, torch.Tensor]] = {}
            counts: dict[str, int] = {}
            for p in self.pairs:
                caps = self.store.captures(p.pair_id, run)
                n = len(p.clean_ids)
                for role in set(p.roles[:n]):
                    counts[role] = counts.get(role, 0) + p.roles[:n].count(role)
                for key, t in caps.items():
                    per = sums.setdefault(key, {})
                    for pos, role in enumerate(p.roles[:n]):
                        per[role] = per.get(role, 0) + t[pos].double()
            self.means[run] = {key: {role: (s / counts[role]).float() for role, s in per.items()}
                               for key, per in sums.items()}
        return self.means[run]
