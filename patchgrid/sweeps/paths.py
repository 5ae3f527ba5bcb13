"""Path patching: does a sender matter through one route?

A sender is a head (its slice of z), or a layer's attn_out or mlp_out. Its contribution to the
stream is what it writes there; denoising, its clean contribution replaces its corrupt one on one
path only, and every other path sees the corrupt run.

- Sender -> logits (the direct effect): the final stream gets the difference of the sender's clean
  and corrupt contributions, nothing else changes. One run: the corrupt prompt with the sender
  patched clean and every attention output and MLP output after it frozen at its corrupt value, so
  that no later component passes the change on.
- Sender -> receiver (a later head's query, key or value input): the receiver computes its q, k or v
  from the corrupt stream plus the sender's difference, through its own norm and projection (and
  rotary embedding); no other reader of the stream sees it. Two passes:
  1. the same frozen run as above, capturing q, k and v of the receivers' layers: with everything
     after the sender frozen, the stream entering any later layer is exactly the corrupt stream
     plus the sender's difference, so these are the receivers' own projections of it;
  2. the corrupt prompt with one receiver head's q, k or v (at the same positions) patched from
     pass 1.
  This is Wang et al.'s (2022) path patching restricted to direct paths, exact (every norm after the
  sender recomputed; not TransformerLens's get_act_patch_direct_path, which linearises through a
  frozen norm scale: docs/methods.md). Wang et al.'s full freeze-and-patch procedure freezes the
  attention heads only and lets the MLPs recompute, so paths through MLPs count too:
  `path_mlps="recomputed"` runs exactly that, in the same two passes.

The sender is patched at one position (or every position at once) and the receiver's input is
patched at the same positions: the stream carries a position's change only at that position. So
a path to the logits from any position but the last is zero by construction (the logits are read
at the last prompt position and past it, where nothing after the sender carries the change): its
reading is the corrupt run's, never run, and a first pass runs there only for the captures of
paths to later heads.
Senders and receivers come from the study's settings (`path_senders`, `path_receivers`,
`path_inputs`); positions are those heads are patched at.
"""
from __future__ import annotations

import dataclasses

from ..cache import CacheSpec, layer_keys, stream_keys
from ..metrics import Reading
from ..model.sites import LOGITS, parse_unit_name, site_key, unit_name
from ..plan import Patch, Request
from .base import Cell, SweepKind, as_runs, baselines, grid_layers, scored, unit_positions
from .path_ends import SENDER_KINDS

FIRST = "path:"  # the run name prefix of a sender's first pass (its captures are pass 2's sources)
MLP_IN = "mlp_in"  # a receiver `mlp_in.L`: layer L's MLP reading the stream (the edges sweep's exact confirmation)


def capture_key(receiver: str) -> str:
    """What a first pass captures for `receiver` (a head's q, k or v; an MLP's input: its neurons,
    which the MLP computes from the stream it reads)."""
    if receiver.startswith(MLP_IN + "."):
        return site_key("neuron", int(receiver.split(".")[1]))
    site, layer, _ = parse_unit_name(receiver)
    return site_key(site, layer)


def receiver_patch(receiver: str, source: str, positions) -> Patch:
    """Pass 2's patch: the receiver's input from pass 1 (a head's q, k or v; an MLP's neurons, every one
    of them, so that its output is what the stream of pass 1 makes of it)."""
    if receiver.startswith(MLP_IN + "."):
        return Patch("neuron", int(receiver.split(".")[1]), source, positions)
    site, layer, unit = parse_unit_name(receiver)
    return Patch(site, layer, source, positions, unit)


class PathSweep(SweepKind):
    ablatable_why = "a path carries the clean run's value through runs frozen at the corrupt one's"
    name, drawing, row_shape = "paths", "paths", "path"
    settings = ("path_senders", "path_receivers", "path_inputs", "path_mlps")

    # ---- the grid ----
    def senders(self, ctx) -> list[tuple[str, int, int | None]]:
        """(site, layer, head or None) of every sender, in the order given."""
        out = []
        for s in ctx.config.path_senders:
            if s in SENDER_KINDS:
                site = SENDER_KINDS[s]
                heads = range(ctx.n_heads) if site == "head" else [None]
                out += [(site, layer, h) for layer in grid_layers(ctx) for h in heads]
            else:
                site, layer, head = parse_unit_name(s)
                self._check(s, layer, head, ctx)
                out.append((site, layer, head))
        return list(dict.fromkeys(out))

    def receivers(self, layer: int, ctx) -> list[str]:
        """The receivers of a sender at `layer`: the logits, and each later receiver head's inputs
        (k and v by the key/value head the head reads)."""
        config, out = ctx.config, []
        group = ctx.n_heads // (ctx.n_kv_heads or ctx.n_heads)
        for r in config.path_receivers:
            if r == LOGITS:
                out.append(LOGITS)
                continue
            heads = ([(L, h) for L in grid_layers(ctx) for h in range(ctx.n_heads)] if r == "heads"
                     else [parse_unit_name(r)[1:]])
            for L, h in heads:
                self._check(r, L, h, ctx)
                if L > layer:
                    out += [unit_name(x, L, h if x == "q" else h // group) for x in config.path_inputs]
        return list(dict.fromkeys(out))

    @staticmethod
    def _check(text, layer, head, ctx):
        if not 0 <= layer < ctx.n_layers or head is not None and not 0 <= head < ctx.n_heads:
            raise ValueError(f"path end {text!r} is outside the model ({ctx.n_layers} layers of {ctx.n_heads} heads)")

    def cells(self, pair, ctx):
        return [Cell(self.name, site, "denoise", layer, pos, head, receiver=r)
                for pos in unit_positions(pair, ctx.config) for site, layer, head in self.senders(ctx)
                for r in self.receivers(layer, ctx)]

    def needs(self, ctx):
        n = ctx.n_layers
        sites = {SENDER_KINDS[s] if s in SENDER_KINDS else parse_unit_name(s)[0] for s in ctx.config.path_senders}
        clean = tuple(k for site in sorted(sites) for k in layer_keys(site, n))
        frozen = layer_keys("attn_out", n) + (layer_keys("mlp_out", n) if ctx.config.path_mlps == "frozen" else ())
        streams = stream_keys(n) if ctx.config.start_midstack else ()
        return CacheSpec(clean, ("clean",), (("corrupt", frozen + streams),))

    # ---- pass 1: the sender patched, everything after it frozen ----
    def prepare(self, ctx, run):
        """The first pass: per pair, sender and position, the sender patched and what follows it
        frozen; its readings and captures go into the context."""
        first, derived, runs = {p.pair_id: {} for p in run.pairs}, {}, []
        for i, p in enumerate(run.pairs):
            change, as_run = self.first_change(p), as_runs(i, ctx, self.metrics_read(p, ctx.config))
            for cell in self.first_cells(p, ctx):
                if ctx.config.start_midstack and self.unchanged(cell, change):
                    continue  # every path of it equals the corrupt run: its cells are unchanged too
                if self.direct_path_is_zero(cell, p):  # its path to the logits: the corrupt run's reading
                    first[p.pair_id][cell] = baselines(run.store.baselines[p.pair_id])[1]
                req = self.first_request(p, cell, ctx, f"{i}:clean", f"{i}:corrupt")
                if req.capture or cell not in first[p.pair_id]:
                    runs.append((i, self, cell, as_run(req, cell)))

        def read(r, res):
            i, _, cell, _ = r
            first[run.pairs[i].pair_id].setdefault(cell, Reading.of(res))
            derived[(run.pairs[i].pair_id, self.first_run(cell))] = res.captures

        run.run(runs, read, ctx)
        return ctx.with_prepared(self.name, first, derived)

    @staticmethod
    def direct_path_is_zero(cell: Cell, pair) -> bool:
        """Whether the sender's path to the logits is zero by construction: patched at one position
        but the last, whose change nothing after the sender carries to where the logits are read."""
        return cell.position is not None and cell.position != len(pair.corrupt_ids) - 1

    def first_cells(self, pair, ctx) -> list[Cell]:
        """One first-pass run per (sender, position) with any receiver (its reading is the
        sender -> logits path)."""
        return list(dict.fromkeys(dataclasses.replace(c, receiver=None) for c in self.cells(pair, ctx)))

    def first_request(self, pair, cell: Cell, ctx, clean: str, corrupt: str, receivers=None) -> Request:
        """The sender patched, what follows it frozen, capturing what `receivers` read (default: the
        sender's receivers by the run's settings). A sender may also be the stream the first layer
        reads (resid_pre at layer 0: the edges sweep's input node), before layer 0's attention."""
        site, layer = cell.site, cell.layer
        positions = None if cell.position is None else (cell.position,)
        patches = [Patch(site, layer, clean, positions, cell.head)]
        n = ctx.n_layers
        # frozen at every row the request computes, the answers' inputs past the prompt too: there the
        # change would otherwise reach the scored answers through later attention
        first_attn = layer if site == "resid_pre" else layer + 1
        patches += [Patch("attn_out", L, corrupt, whole=True) for L in range(first_attn, n)]
        if ctx.config.path_mlps == "frozen":
            first_mlp = layer + 1 if site == "mlp_out" else layer
            patches += [Patch("mlp_out", L, corrupt, whole=True) for L in range(first_mlp, n)]
        receivers = self.receivers(layer, ctx) if receivers is None else receivers
        capture = sorted({capture_key(r) for r in receivers if r != LOGITS})
        return Request(tokens=pair.corrupt_ids, patches=tuple(patches), capture=tuple(capture), **scored(pair))

    @staticmethod
    def first_run(cell: Cell) -> str:
        """The name of a sender's first-pass run, whose captures pass 2 patches from."""
        pos = "all" if cell.position is None else cell.position
        return f"{FIRST}{unit_name(cell.site, cell.layer, cell.head)}@{pos}"

    # ---- pass 2, and the rows ----
    def source_run(self, cell: Cell) -> str:
        return cell.source if cell.receiver == LOGITS else self.first_run(cell)

    def reading_without_run(self, cell: Cell, ctx, pair):
        """A sender -> logits cell's reading is its first pass's."""
        if cell.receiver == LOGITS:
            return ctx.prepared_by(self.name)[pair.pair_id][dataclasses.replace(cell, receiver=None)]
        return None

    def request(self, pair, cell, ctx, source):
        if cell.receiver == LOGITS:  # the first pass (reading_without_run() has its reading)
            pair_index = source.partition(":")[0]  # sources are named `{pair index}:{run}` (sweeps.run)
            return self.first_request(pair, dataclasses.replace(cell, receiver=None), ctx, source,
                                      f"{pair_index}:corrupt")
        positions = None if cell.position is None else (cell.position,)
        return Request(tokens=pair.corrupt_ids, patches=(receiver_patch(cell.receiver, source, positions),),
                       **scored(pair))

