"""Sweeps over many pairs, read from the activation cache, batched across pairs.

    kinds.py   each sweep kind's grid of patched runs, its requests and its effect rows
    config.py  the settings of a sweep run
    run.py     running them: cells -> batched engine calls -> effect rows
    noise.py   the noise causal tracing adds, measured over a data set's subjects
"""
from .config import DEFAULT_SWEEPS, HEAD_POSITION_ROLES, SWEEPS, TRACE_NOISE_SCALE, TRACE_SITES, SweepConfig
from .kinds import SWEEP_KINDS, Cell, SweepContext, SweepKind, kind_for_site, settings_of, trace_seed, trace_window
from .noise import TraceNoise, subject_noise
from .run import cache_spec, check_family, count_runs, patched_runs, run_sweeps, trace_noise_std

__all__ = ["DEFAULT_SWEEPS", "HEAD_POSITION_ROLES", "SWEEPS", "SWEEP_KINDS", "TRACE_NOISE_SCALE", "TRACE_SITES", "Cell", "check_family",
           "SweepConfig", "SweepContext", "SweepKind", "TraceNoise", "subject_noise", "cache_spec", "count_runs", "kind_for_site", "patched_runs",
           "run_sweeps", "settings_of",
           "trace_noise_std", "trace_seed", "trace_window"]
