"""The unpatched runs a cache holds (clean, corrupt, causal tracing's noised runs), run in one
engine call, and the baseline rows of the clean and corrupt runs."""
from __future__ import annotations

from ..metrics import Reading, kl_divergence
from ..plan import Noise, Request, trace_seed
from ..rows.effects import reading_columns
from .captures import NOISED, CacheSpec


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
