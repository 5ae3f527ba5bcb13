"""Sweeps over many pairs, read from the activation cache, batched across pairs.

    resid     layer x position; denoise (clean into corrupt) and noise (corrupt into clean)
    attn_out  layer x position, denoise
    mlp_out   layer x position, denoise
    heads     layer x head: every position at once, and at chosen positions (by role)
    trace     causal tracing (Meng et al.): Gaussian noise on the subject's embeddings, restore
              the clean hidden state at one (layer, position), or the clean MLP / attention output
              over a window of layers at one position; metric: the clean answer's probability

Every effect row carries the patched logit difference and clean-answer probability beside the
pair's baselines, the effect and the recovery, so any metric can be recomputed later.
"""
from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .cache import ActivationCache, CacheSpec, layer_keys
from .pairs.pair import Pair
from .plan import Noise, Patch, Request

SWEEPS = ("resid", "attn_out", "mlp_out", "heads", "trace")
DIRECTIONS = ("denoise", "noise")
HEAD_POSITION_ROLES = ("subject_last", "last")
TRACE_SITES = ("resid", "mlp_out", "attn_out")


@dataclass(frozen=True)
class SweepConfig:
    sweeps: tuple[str, ...] = ("resid", "attn_out", "mlp_out", "heads")
    resid_directions: tuple[str, ...] = DIRECTIONS
    head_position_roles: tuple[str, ...] = HEAD_POSITION_ROLES
    trace_samples: int = 10
    trace_window: int = 10
    trace_noise_scale: float = 3.0  # times the std of the subjects' embeddings over the data set
    trace_sites: tuple[str, ...] = TRACE_SITES  # hidden state, and MLP / attention over a window
    seed: int = 0
    max_requests: int = 2048  # patched runs per engine call: bounds memory

    def __post_init__(self):
        bad = [s for s in self.sweeps if s not in SWEEPS]
        if bad or not self.sweeps:
            raise ValueError(f"unknown sweep {bad[0] if bad else '(none)'!r}; use some of {', '.join(SWEEPS)}")
        bad = [d for d in self.resid_directions if d not in DIRECTIONS]
        if bad:
            raise ValueError(f"unknown direction {bad[0]!r}; use {' or '.join(DIRECTIONS)}")
        bad = [t for t in self.trace_sites if t not in TRACE_SITES]
        if bad or not self.trace_sites:
            raise ValueError(f"unknown trace site {bad[0] if bad else '(none)'}; use some of {', '.join(TRACE_SITES)}")
        if self.trace_samples < 1 or self.trace_window < 1 or self.max_requests < 1:
            raise ValueError("trace_samples, trace_window and max_requests must be at least 1")


def cache_spec(config: SweepConfig, n_layers: int) -> CacheSpec:
    keys: list[str] = []
    runs = ["clean"]
    for sweep in config.sweeps:
        if sweep == "resid":
            keys += layer_keys("resid", n_layers)
            if "noise" in config.resid_directions:
                runs.append("corrupt")
        elif sweep in ("attn_out", "mlp_out"):
            keys += layer_keys(sweep, n_layers)
        elif sweep == "heads":
            keys += layer_keys("head", n_layers)
        elif sweep == "trace":
            for site in config.trace_sites:
                keys += layer_keys(site, n_layers)
            keys.append("embed")
    return CacheSpec(tuple(dict.fromkeys(keys)), tuple(runs))


@dataclass(frozen=True)
class _Meta:
    pair: int  # index into pairs
    sweep: str
    site: str | None  # None: the noised baseline of a trace sample
    direction: str
    layer: int | None
    position: int | None  # None: every position at once
    head: int | None = None
    window: int | None = None


def trace_window(layer: int, window: int, n_layers: int) -> range:
    """Meng et al.'s window: `window` layers centred on `layer`, cut at the model's ends."""
    return range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2)))


def trace_noise_std(cache: ActivationCache, pairs: list[Pair], scale: float) -> float:
    """scale x the std of the subject tokens' embeddings over the data set."""
    rows = [cache.captures(p.pair_id, "clean", ["embed"])["embed"][p.subject_start:p.subject_end].float()
            for p in pairs]
    return scale * float(torch.cat(rows).std())


def trace_seed(seed: int, pair_id: str, sample: int) -> int:
    return zlib.crc32(f"{seed}:{pair_id}:{sample}".encode())


def _jobs(i: int, p: Pair, config: SweepConfig, n_layers: int, n_heads: int, std: float) -> Iterator[tuple]:
    ans = (p.clean_answer_id, p.corrupt_answer_id)
    clean, corrupt = f"{i}:clean", f"{i}:corrupt"
    positions = range(len(p.clean_ids))
    layers = range(n_layers)
    for sweep in config.sweeps:
        if sweep in ("resid", "attn_out", "mlp_out"):
            directions = config.resid_directions if sweep == "resid" else ("denoise",)
            for direction in directions:
                tokens, src = (p.corrupt_ids, clean) if direction == "denoise" else (p.clean_ids, corrupt)
                for layer in layers:
                    for pos in positions:
                        yield (Request(tokens=tokens, answers=ans, patches=(Patch(sweep, layer, src, (pos,)),)),
                               _Meta(i, sweep, sweep, direction, layer, pos))
        elif sweep == "heads":
            chosen = [None] + [p.roles.index(role) for role in config.head_position_roles if role in p.roles]
            for pos in dict.fromkeys(chosen):
                for layer in layers:
                    for head in range(n_heads):
                        patch = Patch("head", layer, clean, None if pos is None else (pos,), head)
                        yield (Request(tokens=p.corrupt_ids, answers=ans, patches=(patch,)),
                               _Meta(i, "heads", "head", "denoise", layer, pos, head))
        elif sweep == "trace":
            for s in range(config.trace_samples):
                noise = (Noise(p.subject_positions, std, trace_seed(config.seed, p.pair_id, s)),)
                yield Request(tokens=p.clean_ids, answers=ans, noise=noise), _Meta(i, "trace", None, "denoise", None, None)
                for layer in layers:
                    window = trace_window(layer, config.trace_window, n_layers)
                    for pos in positions:
                        if "resid" in config.trace_sites:
                            yield (Request(tokens=p.clean_ids, answers=ans, noise=noise,
                                           patches=(Patch("resid", layer, clean, (pos,)),)),
                                   _Meta(i, "trace", "resid", "denoise", layer, pos))
                        for site in [t for t in config.trace_sites if t != "resid"]:
                            patches = tuple(Patch(site, w, clean, (pos,)) for w in window)
                            yield (Request(tokens=p.clean_ids, answers=ans, noise=noise, patches=patches),
                                   _Meta(i, "trace", site, "denoise", layer, pos, None, config.trace_window))


def count_runs(pairs: list[Pair], config: SweepConfig, n_layers: int, n_heads: int) -> int:
    total = 0
    for p in pairs:
        n = len(p.clean_ids)
        for sweep in config.sweeps:
            if sweep == "resid":
                total += len(config.resid_directions) * n_layers * n
            elif sweep in ("attn_out", "mlp_out"):
                total += n_layers * n
            elif sweep == "heads":
                chosen = {None} | {p.roles.index(r) for r in config.head_position_roles if r in p.roles}
                total += len(chosen) * n_layers * n_heads
            elif sweep == "trace":
                total += config.trace_samples * (1 + len(config.trace_sites) * n_layers * n)
    return total


def run_sweeps(engine, pairs: list[Pair], cache: ActivationCache, config: SweepConfig,
               progress: Callable[[int, int], None] | None = None, noise_std: float | None = None) -> list[dict]:
    """All sweeps of `config` over `pairs`; returns effect rows (see module doc).

    noise_std: the trace noise scale, when `pairs` is one shard of a larger data set whose
    subjects set it (trace_noise_std over all pairs); by default it is computed over `pairs`.
    """
    shape = engine.shape
    std = 0.0
    if "trace" in config.sweeps:
        std = noise_std if noise_std is not None else trace_noise_std(cache, pairs, config.trace_noise_scale)
    total = count_runs(pairs, config, shape.n_layers, shape.n_heads)
    rows: list[dict] = []
    trace = _TraceAccumulator()
    done = 0
    buffer: list[tuple] = []

    def flush():
        nonlocal done
        sources = {}
        for _, meta in buffer:
            for run in ("clean", "corrupt"):
                name = f"{meta.pair}:{run}"
                if name not in sources and (run == "clean" or meta.direction == "noise"):
                    sources[name] = cache.captures(pairs[meta.pair].pair_id, run)
        results = engine.run([req for req, _ in buffer], sources)
        for (_, meta), res in zip(buffer, results):
            ld = float(res.answer_logits[0] - res.answer_logits[1])
            p = float(res.answer_probs[0])
            if meta.sweep == "trace":
                trace.add(meta, ld, p)
            else:
                rows.append(_row(pairs[meta.pair], cache, meta, ld, p))
        done += len(buffer)
        buffer.clear()
        if progress:
            progress(done, total)

    for i, p in enumerate(pairs):
        for job in _jobs(i, p, config, shape.n_layers, shape.n_heads, std):
            buffer.append(job)
            if len(buffer) >= config.max_requests:
                flush()
    if buffer:
        flush()
    rows += trace.rows(pairs, cache, config)
    return rows


def _recovery(patched: float, clean: float, corrupt: float) -> float | None:
    span = clean - corrupt
    return None if span == 0 else (patched - corrupt) / span


def _row(pair: Pair, cache: ActivationCache, meta: _Meta, ld: float, p: float) -> dict:
    base = cache.baselines[pair.pair_id]
    clean, corrupt = base["clean_logit_diff"], base["corrupt_logit_diff"]
    return {
        "pair_id": pair.pair_id, "relation": pair.relation, "sweep": meta.sweep, "site": meta.site,
        "direction": meta.direction, "layer": meta.layer, "position": meta.position,
        "position_role": "all" if meta.position is None else pair.roles[meta.position],
        "head": meta.head, "window": meta.window, "metric": "logit_diff",
        "patched_logit_diff": ld, "patched_p": p,
        "clean_logit_diff": clean, "corrupt_logit_diff": corrupt, "clean_p": base["clean_p"],
        "corrupt_p": base["corrupt_p"],
        "effect": ld - (corrupt if meta.direction == "denoise" else clean),
        "recovery": _recovery(ld, clean, corrupt),
    }


class _TraceAccumulator:
    """Averages each restored site over the noise samples; the noised run is the corrupt baseline."""

    def __init__(self):
        self.sums = defaultdict(lambda: [0.0, 0.0, 0])  # (pair, site, layer, pos, window) -> [ld, p, n]

    def add(self, meta: _Meta, ld: float, p: float):
        acc = self.sums[(meta.pair, meta.site, meta.layer, meta.position, meta.window)]
        acc[0] += ld
        acc[1] += p
        acc[2] += 1

    def rows(self, pairs, cache, config) -> list[dict]:
        out = []
        for (i, site, layer, pos, window), (ld, p, n) in self.sums.items():
            if site is None:
                continue
            pair = pairs[i]
            noised_ld, noised_p, k = self.sums[(i, None, None, None, None)]
            noised_ld, noised_p = noised_ld / k, noised_p / k
            base = cache.baselines[pair.pair_id]
            mean_p = p / n
            out.append({
                "pair_id": pair.pair_id, "relation": pair.relation, "sweep": "trace", "site": site,
                "direction": "denoise", "layer": layer, "position": pos, "position_role": pair.roles[pos],
                "head": None, "window": window, "metric": "p",
                "patched_logit_diff": ld / n, "patched_p": mean_p,
                "clean_logit_diff": base["clean_logit_diff"], "corrupt_logit_diff": noised_ld,
                "clean_p": base["clean_p"], "corrupt_p": noised_p,
                "effect": mean_p - noised_p,
                "recovery": _recovery(mean_p, base["clean_p"], noised_p),
            })
        return out
