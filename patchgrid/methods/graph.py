"""The graph circuits are drawn on: nodes and edges as MIB's circuit track and the EAP-IG code
define them.

Nodes: the input (the stream the first layer reads, resid_pre 0: the token embedding, with GPT-2's
position embedding added), every attention head, every MLP (a mixture of experts' routed experts
are one MLP node), and the logits. A node's output is what it adds to the residual stream: a head's
slice of z through its columns of the output projection, an MLP's output. A node's input is the
stream it reads; a head's input is three, the stream its query, its key and its value are projected
from (under grouped-query attention the key and value inputs belong to the key/value head, which
the query heads of its group share).

An edge u -> v carries u's output into v's input: the input and every head and MLP of an earlier
layer into every later head's q, k and v; the heads of a layer into that layer's MLP as well
(unless the block is parallel, where attention and MLP both read the layer's input); every node
into the logits. Senders and receivers are named as text, as path patching names its ends
(sites.unit_name):

    senders    input, head.L.H, mlp_out.L
    receivers  q.L.H, k.L.G, v.L.G (G: the key/value head), mlp_in.L, logits

The edges are the stream's own decomposition only where each sender's output is added to the
stream as it is: a family that normalises attention's summed output before adding it (Gemma 2 and
3, OLMo 2: `Family.attn_out`) has no per-head output in the stream, and is refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..model.sites import LOGITS, ModelShape, site_key

INPUT = "input"


class GraphError(ValueError):
    """A model whose nodes cannot be split into the graph's."""


def unsplittable(family) -> str | None:
    """Why a family's nodes cannot be split into the graph's (None: they can): a norm after attention
    leaves its heads no output of their own in the stream."""
    if family.attn_out is not None:
        return (f"the {family.name} family normalises attention's summed output ({family.attn_out}) before adding "
                "it to the stream: no head has an output of its own there, so its heads cannot be nodes of an edge "
                "graph")
    return None


def check_splittable(shape: ModelShape) -> None:
    why = unsplittable(shape.family)
    if why:
        raise GraphError(why)


@dataclass(frozen=True)
class EdgeGraph:
    """The nodes of one model's graph, senders and receivers in forward order."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel: bool  # attention and MLP of a layer both read its input (no edge head -> MLP of one layer)

    @classmethod
    def of(cls, shape: ModelShape) -> EdgeGraph:
        check_splittable(shape)
        return cls(shape.n_layers, shape.n_heads, shape.kv_heads, shape.family.mlp_norm is None)

    @cached_property
    def senders(self) -> tuple[str, ...]:
        out = [INPUT]
        for layer in range(self.n_layers):
            out += [f"head.{layer}.{h}" for h in range(self.n_heads)] + [f"mlp_out.{layer}"]
        return tuple(out)

    @cached_property
    def receivers(self) -> tuple[str, ...]:
        out = []
        for layer in range(self.n_layers):
            out += [f"q.{layer}.{h}" for h in range(self.n_heads)]
            out += [f"{x}.{layer}.{g}" for x in ("k", "v") for g in range(self.n_kv_heads)]
            out.append(f"mlp_in.{layer}")
        return tuple(out) + (LOGITS,)

    @staticmethod
    def sender_layer(sender: str) -> int:
        """The layer a sender's output is added at (-1: the input)."""
        return -1 if sender == INPUT else int(sender.split(".")[1])

    def receiver_layer(self, receiver: str) -> int:
        """The layer whose input a receiver reads (n_layers: the logits)."""
        return self.n_layers if receiver == LOGITS else int(receiver.split(".")[1])

    def reaches(self, sender: str, receiver: str) -> bool:
        """Whether sender -> receiver is an edge: the sender's output is in the stream the receiver reads."""
        s, r = self.sender_layer(sender), self.receiver_layer(receiver)
        if s < r:
            return True
        # one layer: its heads write before its MLP reads, unless the block is parallel
        return s == r and receiver.startswith("mlp_in.") and sender.startswith("head.") and not self.parallel

    @cached_property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """Every edge as (sender index, receiver index), receivers in forward order, senders within."""
        return tuple((i, j) for j, r in enumerate(self.receivers) for i, s in enumerate(self.senders)
                     if self.reaches(s, r))

    def mask(self):
        """[senders, receivers] bool: True where an edge is."""
        import torch

        out = torch.zeros(len(self.senders), len(self.receivers), dtype=torch.bool)
        for i, j in self.edges:
            out[i, j] = True
        return out


def circuit_keys(n_layers: int) -> list[str]:
    """Every site key holding a sender's output: what a circuit run's source holds."""
    return [site_key("resid_pre", 0)] + [site_key(s, layer) for layer in range(n_layers) for s in ("head", "mlp_out")]
