"""Clean (and corrupt) activations captured once per pair, cached as Arrow IPC files.

Layout of one cache data set, a folder named by its key under the cache root:

    manifest.json    what the key was made of, dtype, widths, pair order, the site keys of each
                     run, each file's size and sha256 and its stat (checked when the set is found:
                     a file whose stat still matches is not read again); written last
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

The package's modules, one job each:
- spec.py    `CacheSpec`: what a study's sweeps need captured, from which runs
- runs.py    the unpatched runs a cache holds (clean, corrupt, noised) and their baseline rows
- arrow.py   how activations are laid out in Arrow columns, and read back as tensors over the mapping
- store.py   the stores sweeps read: `ActivationCache` (a data set on disk), `MemoryStore`
- damage.py  `damage`: a data set checked against the sizes and sha256 sums written with it
- build.py   `load_or_build`: find a sound data set covering a spec, or build one
"""
from .build import CACHE_VERSION, load_or_build, model_identity, pairs_identity
from .captures import NOISED, CacheSpec, layer_keys, stream_keys
from .damage import damage
from .runs import baseline_row, capture_runs, run_request
from .store import ActivationCache, ActivationStore, CacheError, MemoryStore

__all__ = [
    "CACHE_VERSION", "NOISED", "ActivationCache", "ActivationStore", "CacheError", "CacheSpec", "MemoryStore",
    "baseline_row", "capture_runs", "damage", "layer_keys", "load_or_build", "model_identity", "pairs_identity",
    "run_request", "stream_keys",
]
