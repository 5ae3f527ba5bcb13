"""Circuits from edge scores, as MIB's circuit track builds them (the EAP-IG code's `Graph.apply_topn`
and `apply_greedy`), and what a circuit of a given size is.

A circuit of n edges is the first n of an order over the graph's edges (patchgrid.methods.graph), built from
one score per edge (the mean over the run's pairs of each pair's score):

    topn    by |score|, largest first (ties: the graph's order);
    greedy  from the logits down: the candidates are the edges into the logits; the candidate of
            largest |score| is taken next, and when its sender is new to the circuit, the edges into
            that sender's inputs (a head's q, its key/value head's k and v; an MLP's input) become
            candidates too. Every node reaches the logits, so every edge is taken in the end.

Either order holds every smaller circuit inside every larger one. A size is a percentage of the
graph's edges: int(size / 100 * edges) edges, as MIB counts them. MIB then prunes edges that no longer
connect the input to the logits; patchgrid keeps them, so a circuit has exactly the edges its size
says (a difference stated in docs/methods.md).
"""
from __future__ import annotations

import heapq

from .graph import INPUT, EdgeGraph

BUILDS = ("topn", "greedy")


def circuit_size(size: float, n_edges: int) -> int:
    """The number of edges of a circuit of `size` percent of `n_edges` (MIB's count)."""
    return int(size / 100 * n_edges)


def edge_order(graph: EdgeGraph, scores, build: str) -> list[int]:
    """Every edge index (into graph.edges) in the order circuits take them; `scores` [edges] (a tensor)."""
    if build not in BUILDS:
        raise ValueError(f"unknown circuit build {build!r}; use one of {', '.join(BUILDS)}")
    magnitude = scores.abs().tolist()
    if build == "topn":
        return sorted(range(len(magnitude)), key=lambda e: -magnitude[e])
    return _greedy(graph, magnitude)


def _greedy(graph: EdgeGraph, magnitude: list[float]) -> list[int]:
    into: dict[int, list[int]] = {}  # receiver index -> the edges into it
    for e, (_, j) in enumerate(graph.edges):
        into.setdefault(j, []).append(e)
    receiver_index = {r: j for j, r in enumerate(graph.receivers)}
    group = graph.n_heads // graph.n_kv_heads

    def inputs_of(sender: str) -> list[int]:
        """The receivers that are the sender node's inputs."""
        if sender == INPUT:
            return []
        site, layer, *head = sender.split(".")
        if site == "mlp_out":
            return [receiver_index[f"mlp_in.{layer}"]]
        h = int(head[0])
        return [receiver_index[f"{x}.{layer}.{u}"] for x, u in (("q", h), ("k", h // group), ("v", h // group))]

    heap = [(-magnitude[e], e) for e in into.get(len(graph.receivers) - 1, [])]  # into the logits
    heapq.heapify(heap)
    order, nodes, opened = [], set(), set()
    while heap:
        _, e = heapq.heappop(heap)
        order.append(e)
        sender = graph.senders[graph.edges[e][0]]
        if sender not in nodes:
            nodes.add(sender)
            for j in inputs_of(sender):
                if j not in opened:  # a key/value head's inputs are its group's heads' alike
                    opened.add(j)
                    for f in into.get(j, []):
                        heapq.heappush(heap, (-magnitude[f], f))
    return order
