"""Per-step planning: which rows of vLLM's flattened batch belong to which request and position.

A scheduler step runs the rows of many requests back to back ([num_tokens, ...]); batch order is
not submission order, and chunked prefill may split one prompt across steps, so that a request's
first row this step is its position `num_computed_tokens`. At the start of every step the plans of
the step's requests become one vectorised write (rows, values) per site, so each hook does one
indexed copy: the requests' patches are joined as plain lists, and each site key's positions,
rows and values are then selected and gathered once for the whole step (from the stacked sources,
request.Sources). They are put together on the CPU and moved to the activations' device once per step:
on a GPU the values are gathered into pinned memory and copied without blocking (`staged`).
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from ...plan import stream_key
from ...sites import SITES, parse_key
from .request import Request, Sources


class Step:
    def __init__(self):
        self.writes: dict[str, tuple] = {}  # key -> (rows, values)
        self.units: dict[str, tuple] = {}  # head or neuron key -> (rows, units, values)
        self.noise = None  # (rows, values) added to the embedding
        self.start = None  # (rows, values): the stream entering the start layer
        self.captures: dict[str, list] = {}  # key -> [(row0, row1, buffer, pos0)]
        # the rows whose logits are read, in order: [(request, first position, number of rows)], and
        # `read_rows`, their rows in the batch's hidden states, which the final norm's hook unembeds in
        # float32 (readout.LogitsReadout; vLLM's sampler gets a zero column per request during a call)
        self.reads: list[tuple[Request, int, int]] = []
        self.read_rows = None
        self.logits = None  # their float32 logits [rows, vocab] once unembedded (rank 0)
        self.done: list[Request] = []  # requests whose last position is in this step
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


def plan_step(runner, request_of, sources: Sources, start_layer: int, widths: dict, device) -> Step:
    """This step's Step, from vLLM's V1 runner: `request_of(req_id)` is the Request of a vLLM
    request (None: one of no patchgrid call); with `start_layer`, every row's start stream."""
    batch = runner.input_batch
    n = batch.num_reqs
    if n == 0:  # profiling and dummy runs
        return Step()
    qsl = runner.query_start_loc.np[:n + 1].tolist()  # plain ints: numpy's scalars cost more per read
    computed = batch.num_computed_tokens_cpu[:n].tolist()
    plan = _Plan(start_layer)
    for i, rid in enumerate(batch.req_ids[:n]):
        r = request_of(rid)
        if r is None:
            continue
        row0, pos0 = qsl[i], computed[i]
        plan.add(r, row0, pos0, pos0 + (qsl[i + 1] - row0))
    step = plan.finish(sources, widths, staged(device))
    step.to(device)
    return step


class _Plan:
    """A step being planned: a request of the batch holds positions pos0..pos1 of its forward in
    rows row0..."""

    def __init__(self, start_layer: int):
        self.start_layer = start_layer
        self.step = Step()
        # (key, by unit) -> [(a request's patches of that key (Request.patches), its first position this
        # step, its end, its row minus position)], flattened once per step in `finish`
        self.patches: dict[tuple[str, bool], list[tuple]] = {}
        # row spans [(first row, end)]: the rows read, and the rows whose start stream is written with
        # each span's source rows (lists, one per span)
        self.noise, self.caps, self.read_spans = [], {}, []
        self.start_spans, self.start_src = [], []

    def add(self, r: Request, row0: int, pos0: int, pos1: int) -> None:
        row1 = row0 + (pos1 - pos0)
        if self.start_layer:
            self.start_spans.append((row0, row1))
            self.start_src.append(r.start_rows[pos0:pos1])
        for k, entry in r.patches.items():
            got = self.patches.get(k)
            if got is None:
                got = self.patches[k] = []
            got.append((entry, pos0, pos1, row0 - pos0))
        for pos, vals in r.noise:
            sel = (pos >= pos0) & (pos < pos1)
            if sel.any():
                self.noise.append((torch.from_numpy(pos[sel] - pos0 + row0), vals[torch.from_numpy(sel)]))
        if r.circuit is not None:
            self.step.circuit_rows.append((r, row0, pos0, pos1))
        if r.pattern_patches or r.knockout is not None:
            self.step.attention_rows.append((r, row0, pos0, pos1))
        for key, buf in r.captures.items():
            self.caps.setdefault(key, []).append((row0, row1, buf, pos0))
        self._add_reads(r, row0, pos0, pos1)
        if pos1 >= r.n_tokens:
            self.step.done.append(r)

    def _add_reads(self, r: Request, row0: int, pos0: int, pos1: int) -> None:
        """Positions n_prompt - 1 .. n_tokens - 1 are read: the last prompt position, and the
        positions predicting each continuation's tokens."""
        lo = max(pos0, r.n_prompt - 1)
        if lo >= pos1:
            return
        self.step.reads.append((r, lo, pos1 - lo))
        self.read_spans.append((lo - pos0 + row0, pos1 - pos0 + row0))

    def finish(self, sources: Sources, widths: dict, pin: bool = False) -> Step:
        step = self.step
        if self.patches:
            self._patch_writes(sources, widths, pin)
        if self.noise:
            step.noise = _cat2(self.noise)
        if self.start_spans:
            key = stream_key(self.start_layer)
            rows = _spanned(self.start_spans)
            src = np.fromiter(chain.from_iterable(self.start_src), dtype=np.int64, count=len(rows))
            step.start = (torch.from_numpy(rows), _gather(sources.rows[key], torch.from_numpy(src), pin))
        step.captures = self.caps
        if self.read_spans:
            step.read_rows = torch.from_numpy(_spanned(self.read_spans))
        return step

    def _patch_writes(self, sources: Sources, widths: dict, pin: bool) -> None:
        """Each site key's writes this step (Step.writes, Step.units): every request's patch lists
        flattened once for all keys and the positions this step computes kept, their rows made one
        tensor; each key's part of them (a key's entries lie together) is a slice of it, and its
        values one index of its stacked sources (a head's or neuron's: of the sources viewed as
        one row per unit)."""
        step, groups = self.step, list(self.patches.items())
        entries = [e for _, es in groups for e in es]
        counts = np.fromiter((len(e[0][0]) for e in entries), dtype=np.int64, count=len(entries))
        pos, src = (np.fromiter(chain.from_iterable(e[0][k] for e in entries), dtype=np.int64) for k in (0, 1))
        # each request's first position this step, its end and its row minus position, per patched position
        lo, hi, shift = np.repeat(np.array([e[1:] for e in entries], dtype=np.int64), counts, axis=0).T
        computed = (pos >= lo) & (pos < hi)
        rows = torch.from_numpy(pos[computed] + shift[computed])
        # where each key's patched positions begin and end, among all (edges) and among those kept
        edges = _starts(counts)[_starts([len(es) for _, es in groups])]
        kept = _starts(computed)[edges]
        for ((key, by_unit), es), a, b, ka, kb in zip(groups, edges, edges[1:], kept, kept[1:]):
            if ka == kb:
                continue
            sel = computed[a:b]
            if not by_unit:
                step.writes[key] = (rows[ka:kb], _gather(sources.rows[key], torch.from_numpy(src[a:b][sel]), pin))
                continue
            units, model_units = (np.fromiter(chain.from_iterable(e[0][k] for e in es), dtype=np.int64)[sel]
                                  for k in (2, 3))
            unit = SITES[parse_key(key)[0]].unit
            uw, n_units = widths["unit_width"][unit], widths["units"][unit]
            # the unit's slice of each source row (sources hold the whole model's width): row r's unit u is
            # row r * units + u of the sources viewed one unit a row
            index = torch.from_numpy(src[a:b][sel] * n_units + model_units)
            values = _gather(sources.rows[key].view(-1, uw), index, pin)
            step.units[key] = (rows[ka:kb], torch.from_numpy(units), values)


def _starts(counts) -> np.ndarray:
    """Where each of `counts` begins when they are laid one after another, and the end: [0, c0, c0 + c1, ...]."""
    return np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))


def _spanned(spans: list[tuple[int, int]]) -> np.ndarray:
    """The rows of `spans` [(first row, end)], one span after another (int64)."""
    lo, hi = np.array(spans, dtype=np.int64).reshape(-1, 2).T
    lengths = hi - lo
    return np.arange(lengths.sum()) + np.repeat(lo - _starts(lengths)[:-1], lengths)


def _cat2(pairs) -> tuple:
    return torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])
