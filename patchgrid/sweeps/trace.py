"""Causal tracing (Meng et al.): Gaussian noise on the subject's embeddings, restore the clean
hidden state at one (layer, position), or the clean MLP / attention output over a window of layers
at one position; metric: the clean answer's probability, averaged over samples. It runs on the
facts the model knows alone (populations.TRACED_FACTS), by the trace_facts rule (pairs.known.TRACE_FACTS)."""
from __future__ import annotations

import dataclasses
from collections import defaultdict

from ..cache import CacheSpec, layer_keys, stream_keys
from ..metrics import Reading
from ..plan import Noise, Patch, Request, trace_seed
from ..rows.effects import effect_row
from .base import Cell, SweepKind, baselines, every_position, grid_layers, scored, trace_window
from .populations import TRACED_FACTS


def trace_noise_std(store, pairs, scale: float) -> float:
    """scale x the std of the subject tokens' embeddings over `pairs`."""
    import torch  # here, not at the top: the light commands import the sweeps and need no torch

    rows = [store.captures(p.pair_id, "clean", ["embed"])["embed"][p.subject_start:p.subject_end].float()
            for p in pairs]
    return scale * float(torch.cat(rows).std())


class TraceSweep(SweepKind):
    """Causal tracing (Meng et al.): the clean prompt with noise on the subject's embeddings; per
    sample, the noised run itself and one run per restored site. Rows average over samples and
    take the noised run as the corrupt baseline."""
    ablatable_why = "it restores the clean run's states into runs noised from it"

    name, metric, drawing, row_shape = "trace", "p", "trace_buckets", "noised"
    population, noised = TRACED_FACTS, True
    settings = ("trace_samples", "trace_window", "trace_noise_scale", "trace_sites", "trace_facts")

    def settle(self, ctx, run):
        """The noise std: the one given for the whole data set; else the one the cached noised runs
        were drawn with; else measured over the run's pairs."""
        if run.noise_std is not None:
            std = run.noise_std
        elif run.store.spec.noised():
            std = run.store.spec.noise[0]
        else:
            std = trace_noise_std(run.store, run.pairs, ctx.config.trace_noise_scale)
        return dataclasses.replace(ctx, noise_std=std)

    def needs(self, ctx):
        config = ctx.config
        keys = tuple(k for site in config.trace_sites for k in layer_keys(site, ctx.n_layers)) + ("embed",)
        noised = ()
        if config.start_midstack:
            if not ctx.noise_std > 0:
                raise ValueError("causal tracing caches its noised runs to start restored runs from: give the noise "
                                 f"std (cache_spec(..., noise_std); got {ctx.noise_std}), or start_midstack=False")
            noised = tuple((Cell(self.name, None, sample=s).base_run, stream_keys(ctx.n_layers))
                           for s in range(config.trace_samples))
        return CacheSpec(keys, ("clean",), noised, (ctx.noise_std, config.seed) if noised else None)

    def cells(self, pair, ctx):
        config, out = ctx.config, []
        positions = every_position(pair, config)
        windowed = [s for s in config.trace_sites if s != "resid"]
        for s in range(config.trace_samples):
            out.append(Cell(self.name, None, sample=s))
            for layer in grid_layers(ctx):
                for pos in positions:
                    if "resid" in config.trace_sites:
                        out.append(Cell(self.name, "resid", "denoise", layer, pos, sample=s))
                    for site in windowed:
                        out.append(Cell(self.name, site, "denoise", layer, pos, None, config.trace_window, s))
        return out

    def request(self, pair, cell, ctx, source):
        config = ctx.config
        noise = (Noise(pair.subject_positions, ctx.noise_std, trace_seed(config.seed, pair.pair_id, cell.sample)),)
        if cell.site is None:
            patches = ()
        elif cell.window is None:
            patches = (Patch(cell.site, cell.layer, source, (cell.position,)),)
        else:
            patches = tuple(Patch(cell.site, w, source, (cell.position,))
                            for w in trace_window(cell.layer, cell.window, ctx.n_layers))
        return Request(tokens=pair.clean_ids, noise=noise, patches=patches, **scored(pair))

    def first_change(self, pair):
        return min(pair.subject_positions)  # the noise: the clean prompt's tokens are the same

    def same_run(self, cell):
        return Cell(self.name, None, sample=cell.sample)  # that sample's noised run

    def rows(self, pair, readings, baseline, ctx):
        samples = defaultdict(list)  # restored site (sample dropped) -> its samples' readings
        for cell, r in readings:
            samples[dataclasses.replace(cell, sample=None)].append(r)
        noised = Reading.mean(samples.pop(Cell(self.name, None)))
        clean, _ = baselines(baseline)
        out = []
        for cell, got in samples.items():
            row = effect_row(pair, cell, Reading.mean(got), clean, noised, self.metric)
            if cell.window is not None:  # the layers actually restored: the window is cut at the model's ends
                row["window"] = len(trace_window(cell.layer, cell.window, ctx.n_layers))
            out.append(row)
        return out
