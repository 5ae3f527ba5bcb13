"""Sweeps over many pairs, read from the activation cache, batched across pairs.

    base.py         what a sweep kind is: Cell, SweepContext, SweepRun (what its phases work with), SweepKind
    registry.py     every kind, registered once, and what the kinds of a run declare together
    registered.py   SWEEP_KINDS, the table the registry fills: the settings check kinds' names against it
    position.py     PositionSweep: one site at one (layer, position) per run (resid, attn_out, mlp_out, ...)
    units.py        UnitSweep: one head, neuron or q/k/v slice per run (heads, neurons, qkv)
    pattern.py      PatternSweep: one head's attention pattern per run (a UnitSweep)
    trace.py        TraceSweep: causal tracing
    knockout.py     KnockoutSweep: attention edges from the last position blocked
    atp.py          AtpSweep: attribution patching, verified by exact patching
    paths.py        PathSweep: path patching (path_ends.py: its settings' senders and receivers)
    edges.py        EdgeSweep: every edge scored by EAP or EAP-IG, the strongest patched exactly
    circuit.py      CircuitSweep: circuits built from the edges' scores, judged by faithfulness
    populations.py  what a study runs a kind on (accepted pairs, or the facts the model knows alone)
    config.py       the settings of a sweep run
    run.py          running them: phases, cells -> batched engine calls -> effect rows
    noise.py        the noise causal tracing adds, measured over a data set's subjects
    ablated.py      the mean or zero sources of a run whose patches are ablations
"""
from ..plan import trace_seed
from .base import Cell, SweepContext, SweepKind, SweepRun, trace_window
from .config import DEFAULT_SWEEPS, HEAD_POSITION_ROLES, TRACE_NOISE_SCALE, TRACE_SITES, SweepConfig
from .noise import TraceNoise, subject_noise
from .populations import POPULATIONS, Population
from .registry import (
                       SWEEP_KINDS,
                       aligning_asks_model,
                       by_population,
                       kind_for_site,
                       noised,
                       settings_of,
                       spans_data_set,
)
from .run import cache_spec, check_family, count_runs, patched_runs, run_sweeps
from .trace import trace_noise_std

__all__ = ["DEFAULT_SWEEPS", "HEAD_POSITION_ROLES", "POPULATIONS", "SWEEP_KINDS", "TRACE_NOISE_SCALE",
           "TRACE_SITES", "Cell", "Population", "SweepConfig", "SweepContext", "SweepKind", "SweepRun", "TraceNoise",
           "aligning_asks_model", "by_population", "cache_spec", "check_family", "count_runs", "kind_for_site",
           "noised", "patched_runs", "run_sweeps", "settings_of", "spans_data_set", "subject_noise", "trace_noise_std",
           "trace_seed", "trace_window"]
