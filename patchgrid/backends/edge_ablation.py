"""A circuit run: the edge-level intervention MIB's circuit track evaluates a circuit by (its
`evaluate_graph`), computed the same way by both backends.

The run is the request's own forward (the clean prompt). Every edge sender -> receiver of
patchgrid.methods.graph outside the circuit is ablated: the receiver reads its stream with that sender's
output replaced by the sender's output in the circuit's source (the corrupt run, or a mean, or
zeros),

    receiver input = stream + sum over ablated senders s of (s in the source - s now),

where "now" is the sender's output in this very run (itself changed by the ablations below it). The
stream itself is left as it is: only the receivers read the changed input. A head's query, key and
value are three receivers, each projected from its own input: the worker runs the layer's
attention norm and attention module on each changed input (stacked), reads q, k and v where the
attention kernel receives them and stops there, then runs the real attention with each receiver's
head slice put in (so that the KV cache holds what attention read). An MLP reads its own input
through its norm; the logits read the final norm of theirs.

A request whose answers are scored whole runs one forward per answer of several tokens
(plan.forwards): past the prompt, a forward's rows read the source's rows of the same tree (the
source run scored the same continuations after its own prompt).

With every edge kept the run is the clean run (no receiver changes); with none kept every receiver
reads the source's stream, so the run is the source run (to rounding).

Sender outputs: the input is the stream entering layer 0 (resid_pre.0); a head's output is its
slice of z through its columns of the output projection (the projection's bias belongs to no head:
it is in both runs alike); an MLP's is its output. The deltas are held in float32 per sender,
[senders, rows, d_model], and summed per receiver by the ablated-edge mask, at the layer that reads
them. Families with a parallel block (attention and MLP reading one norm of the layer's input) are
refused: their MLP's own input would need the shared norm run again, which is not built.
"""
from __future__ import annotations

import torch

from ..methods.graph import EdgeGraph, circuit_keys
from ..plan import PlanError, tree_len


def check_circuits(requests, sources, shape) -> None:
    """Refuse circuit requests that cannot run as asked, naming the field."""
    graph = None
    for i, r in enumerate(requests):
        if r.circuit is None:
            continue
        where = f"request {i}: circuit"
        graph = graph or _circuit_graph(where, shape)
        if r.patches or r.noise or r.start is not None:
            raise PlanError(f"{where}: a circuit run takes no patches, noise or start of its own")
        kept, n_edges = r.circuit.kept, len(graph.edges)
        if kept and (min(kept) < 0 or max(kept) >= n_edges):
            raise PlanError(f"{where}: kept edge index out of range (the graph has {n_edges} edges)")
        _check_source(where, r, sources, shape)


def _circuit_graph(where, shape) -> EdgeGraph:
    try:
        graph = EdgeGraph.of(shape)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}") from None
    if graph.parallel:
        raise PlanError(f"{where}: the {shape.family.name} block is parallel (attention and MLP read one norm of "
                        "the layer's input); circuit runs are built for sequential blocks only")
    return graph


def _check_source(where, r, sources, shape) -> None:
    name = r.circuit.source
    if name not in sources:
        raise PlanError(f"{where}: source {name!r} is not among the call's sources")
    for key in circuit_keys(shape.n_layers):
        t = sources[name].get(key)
        if t is None:
            raise PlanError(f"{where}: source {name!r} holds no {key}, a sender's output")
        width = shape.width(key.split(".")[0])
        if t.dim() != 2 or t.shape[0] < tree_len(r) or t.shape[1] != width:
            raise PlanError(f"{where}: source {name!r} {key} has shape {tuple(t.shape)}, expected "
                            f"[{tree_len(r)}, {width}] (the prompt and its continuations' inputs)")


# What a call's (or a batch's) circuit runs may hold in senders' deltas at once: senders x tokens x
# d_model float32 per forward (a 20-token forward: 12.5 MB on smollm2-135m, 346 MB on an 8B Llama).
# Engines cut their calls (batches) of circuit runs so that the forwards' deltas stay under it.
CIRCUIT_DELTA_BYTES = 2 << 30


def delta_bytes(req, shape) -> int:
    """The bytes of a circuit request's senders' deltas (0: no circuit), over its longest forward."""
    if req.circuit is None:
        return 0
    senders = 1 + shape.n_layers * (shape.n_heads + 1)
    return senders * tree_len(req) * shape.d_model * 4


def cut_by_deltas(items: list, bytes_of, budget: int | None = None) -> list[list]:
    """`items` in order, cut into runs whose summed bytes_of stay under `budget` (CIRCUIT_DELTA_BYTES by
    default; an item over it alone is a run of its own)."""
    budget = CIRCUIT_DELTA_BYTES if budget is None else budget
    out, current, held = [], [], 0
    for item in items:
        b = bytes_of(item)
        if current and held + b > budget:
            out.append(current)
            current, held = [], 0
        current.append(item)
        held += b
    return out + ([current] if current else [])


class Layout:
    """Where each sender and receiver of a graph sits (EdgeGraph's order), per layer, and the mask of
    edges [senders, receivers] (float32, on `device`), made once per engine call."""

    def __init__(self, graph: EdgeGraph, device):
        self.graph = graph
        h, g = graph.n_heads, graph.n_kv_heads
        self.per_layer_senders = h + 1
        self.per_layer_receivers = h + 2 * g + 1
        self.edge_mask = graph.mask().to(device=device, dtype=torch.float32)
        edges = torch.tensor(graph.edges, dtype=torch.long)
        self.edge_senders, self.edge_receivers = edges[:, 0], edges[:, 1]

    def head_senders(self, layer: int) -> int:
        """The index of head 0 of `layer` (its heads follow, then its MLP)."""
        return 1 + layer * self.per_layer_senders

    def mlp_sender(self, layer: int) -> int:
        return self.head_senders(layer) + self.graph.n_heads

    def attention_receivers(self, layer: int) -> range:
        """q.L.0.., k.L.0.., v.L.0.. in order."""
        first = layer * self.per_layer_receivers
        return range(first, first + self.per_layer_receivers - 1)

    def mlp_receiver(self, layer: int) -> int:
        return (layer + 1) * self.per_layer_receivers - 1

    @property
    def logits_receiver(self) -> int:
        return self.graph.n_layers * self.per_layer_receivers

    def ablated(self, kept) -> torch.Tensor:
        """[senders, receivers] float32: 1 on every edge outside the circuit `kept` (edge indices)."""
        out = self.edge_mask.clone()
        if kept:
            idx = torch.as_tensor(kept, dtype=torch.long)
            out[self.edge_senders[idx].to(out.device), self.edge_receivers[idx].to(out.device)] = 0.0
        return out


class Ablation:
    """One forward's (or one step's rows of it) edge intervention: the ablated mask and the senders'
    deltas (source - now) so far, [senders, rows, d_model] float32."""

    def __init__(self, layout: Layout, ablated: torch.Tensor, n_rows: int, d_model: int, device):
        self.layout = layout
        self.ablated = ablated
        self.deltas = torch.zeros(ablated.shape[0], n_rows, d_model, dtype=torch.float32, device=device)

    def add(self, first: int, deltas: torch.Tensor) -> None:
        """Senders first.. (deltas [senders, rows, d_model])."""
        self.deltas[first:first + deltas.shape[0]] = deltas.float()

    def receives(self, receivers) -> list[int]:
        """Those of `receivers` with an ablated edge into them (the others read their stream)."""
        idx = torch.as_tensor(list(receivers), dtype=torch.long, device=self.ablated.device)
        return idx[self.ablated[:, idx].any(0)].tolist()

    def inputs(self, stream: torch.Tensor, receivers: list[int]) -> torch.Tensor:
        """[len(receivers), rows, d_model] float32: the stream (rows, d_model) each receiver reads."""
        mask = self.ablated[:, receivers]  # [senders, r]
        delta = torch.einsum("sr,snd->rnd", mask, self.deltas)
        return stream.float()[None] + delta


def head_outputs(o_proj, dz: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[heads, rows, d_model] float32: each head's slice of `dz` [rows, heads * head_dim] through the
    output projection `o_proj` (a module's forward: its bias taken back out)."""
    rows, width = dz.shape
    hd = width // n_heads
    block = torch.zeros(n_heads, rows, n_heads, hd, dtype=dz.dtype, device=dz.device)
    heads = torch.arange(n_heads, device=dz.device)
    block[heads, :, heads] = dz.view(rows, n_heads, hd).transpose(0, 1)
    out = _linear_out(o_proj(block.view(n_heads * rows, width)))
    bias = _linear_out(o_proj(torch.zeros(1, width, dtype=dz.dtype, device=dz.device)))
    return (out.float() - bias.float()).view(n_heads, rows, -1)


def _linear_out(out):
    """A projection's output tensor (vLLM's linear layers return (output, bias))."""
    return out[0] if isinstance(out, tuple) else out


class Abort(Exception):
    """Raised at the attention kernel once the receivers' q, k and v are read: nothing past them runs."""


def receiver_qkv(captured, receivers: list[int], layout: Layout, rows: int, head_dim: int) -> dict:
    """From q, k, v captured over stacked receiver inputs (each [len(receivers) * rows, heads *
    head_dim], in `receivers`' order), each receiver's own slice: {(site, head): [rows, head_dim]}."""
    h, g = layout.graph.n_heads, layout.graph.n_kv_heads
    out = {}
    for k, r in enumerate(receivers):
        local = r % layout.per_layer_receivers
        site, head = ("q", local) if local < h else ("k", local - h) if local < h + g else ("v", local - h - g)
        t = captured["qkv".index(site)]
        out[(site, head)] = t[k * rows:(k + 1) * rows].view(rows, -1, head_dim)[:, head]
    return out
