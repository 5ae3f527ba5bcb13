"""The values a patch takes under `ablation` mean or zero (sweeps.config; the source names are
sweeps.base.source_name's): zeros, or the mean over the run's pairs of a cached run's values at each
position role (a pair's position takes the mean of its role; the rows past the prompt, where answers
of several tokens are scored, the mean over every pair's such rows, role `continuation`). The mean is
over the pairs of this run_sweeps call: a study runs a circuit's pairs in one shard
(SweepKind.spans_data_set); the site sweeps' shards take each its own mean (docs/methods.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..model.sites import parse_key

CONTINUATION = "continuation"  # the role of a row past the prompt (an answer's input)

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
        rows = n + sum(len(c) - 1 for c in pair.continuations)  # the prompt, then the answers' inputs past it
        if how == "zero":
            return {k: torch.zeros(rows, self.shape.width(parse_key(k)[0])) for k in keys}
        if how != "mean":
            raise ValueError(f"source {name!r}: unknown ablation {how!r}")
        means = self._means(run)
        missing = [k for k in keys if k not in means]
        if missing:
            raise ValueError(f"source {name!r}: the cache's {run} run holds no {missing[0]} to take the mean of")
        roles = list(pair.roles[:n]) + [CONTINUATION] * (rows - n)
        return {k: torch.stack([means[k][role] for role in roles]) for k in keys}

    def _means(self, run: str) -> dict[str, dict[str, torch.Tensor]]:
        if run not in self.means:
            sums: dict[str, dict[str, torch.Tensor]] = {}
            counts: dict[str, int] = {}
            for p in self.pairs:
                caps = self.store.captures(p.pair_id, run)
                n = len(p.clean_ids)
                for key, t in caps.items():
                    per = sums.setdefault(key, {})
                    roles = list(p.roles[:n]) + [CONTINUATION] * (len(t) - n)
                    if key == next(iter(caps)):  # every key of a run holds the same rows
                        for role in roles:
                            counts[role] = counts.get(role, 0) + 1
                    for pos, role in enumerate(roles):
                        per[role] = per.get(role, 0) + t[pos].double()
            self.means[run] = {key: {role: (s / counts[role]).float() for role, s in per.items()}
                               for key, per in sums.items()}
        return self.means[run]
