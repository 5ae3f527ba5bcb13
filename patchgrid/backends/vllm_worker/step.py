"""Per-step planning: which rows of vLLM's flattened batch belong to which request and position.

A scheduler step runs the rows of many requests back to back ([num_tokens, ...]); batch order is
not submission order, and chunked prefill may split one prompt across steps, so that a request's
first row this step is its position `num_computed_tokens`. At the start of every step the step's
requests, found by plan (the k of request.request_id), become one vectorised write (rows, values)
per site, so each hook does one indexed copy: their patches are selected from the call's columns
(columns.Columns) in a few array operations for the whole step, and each site key's values gathered
once (from the stacked sources, request.Sources); so are the rows the readout reads and the start
stream. Only the requests that hold more (noise, captures, circuits, recomputed heads:
held.HeldRequest) are visited one by one. Everything is put together on the CPU and moved to the
activations' device once per step: on a GPU the values are gathered into pinned memory and copied
without blocking (`staged`).
"""
from __future__ import annotations

import numpy as np
import torch

from ...model.sites import SITES, parse_key
from ...plan import stream_key
from .columns import Columns, entries
from .held import HeldRequest, Sources

_NONE = np.zeros(0, dtype=np.int64)


class Step:
    def __init__(self):
        self.writes: dict[str, tuple] = {}  # key -> (rows, values)
        self.units: dict[str, tuple] = {}  # head or neuron key -> (rows, units, values)
        self.noise = None  # (rows, values) added to the embedding
        self.start = None  # (rows, values): the stream entering the start layer
        self.captures: dict[str, list] = {}  # key -> [(row0, row1, buffer, pos0)]
        # the reads of logits, in order: each read's plan, its first position and its number of rows (numpy
        # arrays); and `read_rows`, their rows in the batch's hidden states, which the final norm's hook
        # keeps and unembeds in float32 once they fill whole blocks (readout.LogitsReadout; vLLM's sampler
        # gets a zero column per request during a call)
        self.read_plans = self.read_first = self.read_count = _NONE
        self.read_rows = None
        self.done = _NONE  # the plans whose last position is in this step
        self.done_special: list[HeldRequest] = []  # those of them that hold more (columns.Columns.special)
        # circuit runs: [(request, first row, first position, end position)], and once the circuit
        # hooks have begun the step, [(rows, edge_ablation.Ablation, source values)] (circuit.CircuitHooks)
        self.circuit_rows: list[tuple] = []
        self.circuits: list[tuple] = []
        # requests whose heads' outputs some layer recomputes (pattern patches, knockouts):
        # [(request, first row, first position, end position)]; and per head key (head.L) the rows
        # recomputed this step, [(rows, units or None, values)], which the output projection's hook writes
        self.attention_rows: list[tuple] = []
        self.recomputed: dict[str, list] = {}

    def to(self, device) -> None:
        """One transfer per tensor per step, to where the activations are (without blocking from
        pinned memory on a GPU: staged)."""
        nb = staged(device)
        self.writes = {k: tuple(t.to(device, non_blocking=nb) for t in v) for k, v in self.writes.items()}
        self.units = {k: tuple(t.to(device, non_blocking=nb) for t in v) for k, v in self.units.items()}
        if self.noise is not None:
            self.noise = tuple(t.to(device, non_blocking=nb) for t in self.noise)
        if self.start is not None:
            self.start = tuple(t.to(device, non_blocking=nb) for t in self.start)
        if self.read_rows is not None:
            self.read_rows = self.read_rows.to(device, non_blocking=nb)


def staged(device) -> bool:
    """Whether a step's values go to `device` from pinned host memory, copied without blocking (a
    GPU's); elsewhere they are copied plainly."""
    return torch.device(device).type == "cuda"


def _gather(source: torch.Tensor, index: torch.Tensor, pin: bool) -> torch.Tensor:
    """source[index], into pinned memory when `pin` (the copy to the GPU then need not block; the
    caching host allocator keeps the block until that copy is done). `index_select`: on the CPU an
    order of magnitude faster than `source[index]`, which goes through the general advanced-indexing
    kernel."""
    out = torch.empty((len(index),) + tuple(source.shape[1:]), dtype=source.dtype, pin_memory=True) if pin else None
    return torch.index_select(source, 0, index, out=out)


def plan_step(runner, plans_of, columns: Columns, sources: Sources, start_layer: int, widths: dict, device) -> Step:
    """This step's Step, from vLLM's V1 runner: `plans_of(req_ids)` are the plans (k) its vLLM requests
    run (-1: one of no patchgrid call); with `start_layer`, every row's start stream."""
    batch = runner.input_batch
    n = batch.num_reqs
    if n == 0:  # profiling and dummy runs
        return Step()
    plans = plans_of(batch.req_ids[:n])
    qsl = runner.query_start_loc.np[:n + 1].astype(np.int64)
    computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
    ours = plans >= 0
    if not ours.all():
        plans, qsl, computed = plans[ours], qsl[np.append(ours, True)], computed[ours]
    row0, pos0 = qsl[:-1], computed
    pos1 = pos0 + np.diff(qsl)
    shift = row0 - pos0  # a position's row in the batch, less the position
    step = Step()
    pin = staged(device)
    _reads(step, columns, plans, pos0, pos1, shift)
    done = pos1 >= columns.n_tokens[plans]  # the plans whose last position this step computes
    step.done = plans[done]
    if len(columns.patch_pos):
        _patch_writes(step, columns, plans, pos0, pos1, shift, sources, widths, pin)
    if start_layer:
        rows = _spanned(row0, row0 + pos1 - pos0)
        first = columns.start_start[plans]
        src = torch.from_numpy(columns.start_src[_spanned(first + pos0, first + pos1)])
        step.start = (torch.from_numpy(rows), _gather(sources.rows[stream_key(start_layer)], src, pin))
    if columns.special:
        _add_special(step, columns, plans, row0, pos0, pos1, done)
    step.to(device)
    return step


def _reads(step: Step, columns: Columns, plans, pos0, pos1, shift) -> None:
    """Positions n_prompt - 1 .. n_tokens - 1 are read: the last prompt position, and the positions
    predicting each continuation's tokens."""
    lo = np.maximum(pos0, columns.n_prompt[plans] - 1)
    read = lo < pos1
    if not read.any():
        return
    step.read_plans, step.read_first, step.read_count = plans[read], lo[read], (pos1 - lo)[read]
    step.read_rows = torch.from_numpy(_spanned(lo[read] + shift[read], pos1[read] + shift[read]))


def _patch_writes(step: Step, columns: Columns, plans, pos0, pos1, shift, sources: Sources, widths: dict,
                  pin: bool) -> None:
    """Each site key's writes this step (Step.writes, Step.units): the step's plans' patch entries
    whose positions it computes, their rows in the batch, grouped by key (a stable sort keeps each
    key's in batch order); each key's values one index of its stacked sources (a head's or neuron's: of
    the sources viewed as one row per unit)."""
    c = columns
    entry, owner = entries(c.patch_start[plans], c.patch_count[plans])
    pos = c.patch_pos[entry]
    computed = (pos >= pos0[owner]) & (pos < pos1[owner])
    entry, rows = entry[computed], pos[computed] + shift[owner[computed]]
    if not len(entry):
        return
    group = c.patch_group[entry]
    order = np.argsort(group, kind="stable")
    entry, rows, group = entry[order], rows[order], group[order]
    edges = np.concatenate(([0], np.flatnonzero(np.diff(group)) + 1, [len(group)]))
    rows = torch.from_numpy(rows)
    for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
        key, by_unit = c.groups[group[a]]
        src = c.patch_src[entry[a:b]]
        if not by_unit:
            step.writes[key] = (rows[a:b], _gather(sources.rows[key], torch.from_numpy(src), pin))
            continue
        unit = SITES[parse_key(key)[0]].unit
        uw, n_units = widths["unit_width"][unit], widths["units"][unit]
        # the unit's slice of each source row (sources hold the whole model's width): row r's unit u is
        # row r * units + u of the sources viewed one unit a row
        index = torch.from_numpy(src * n_units + c.patch_model_unit[entry[a:b]])
        step.units[key] = (rows[a:b], torch.from_numpy(c.patch_unit[entry[a:b]]),
                           _gather(sources.rows[key].view(-1, uw), index, pin))


def _add_special(step: Step, columns: Columns, plans, row0, pos0, pos1, done) -> None:
    """What the step's requests that hold more (held.HeldRequest) add: noise at the positions it
    computes, their circuit and recomputed heads' rows, their captures' buffers; and those that finish."""
    noise = []
    for i in np.flatnonzero(columns.is_special[plans]).tolist():
        r = columns.special[int(plans[i])]
        a, b, row = int(pos0[i]), int(pos1[i]), int(row0[i])
        for pos, vals in r.noise:
            sel = (pos >= a) & (pos < b)
            if sel.any():
                noise.append((torch.from_numpy(pos[sel] - a + row), vals[torch.from_numpy(sel)]))
        if r.circuit is not None:
            step.circuit_rows.append((r, row, a, b))
        if r.pattern_patches or r.knockout is not None:
            step.attention_rows.append((r, row, a, b))
        for key, buf in r.captures.items():
            step.captures.setdefault(key, []).append((row, row + b - a, buf, a))
        if done[i]:
            step.done_special.append(r)
    if noise:
        step.noise = torch.cat([a for a, _ in noise]), torch.cat([b for _, b in noise])


def _spanned(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The rows of the spans lo[i]..hi[i] (end excluded), one span after another (int64)."""
    return entries(lo, hi - lo)[0]
