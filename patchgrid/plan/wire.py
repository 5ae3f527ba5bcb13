"""Requests and tensors as plain data for vLLM's worker: a call's plans and tensors travel through
collective_rpc (msgpack across a process boundary in multiprocess mode), as lists, numbers, strings
and bytes."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .forwards import Forward
from .request import Circuit, Knockout, Noise, Patch, Request, Start

if TYPE_CHECKING:  # imported where it is used: the light commands import the plan and need no torch
    import torch


def to_wire(req: Request, tag: str, fwd: Forward | None = None) -> list:
    """One plan as plain data (no tokens: vLLM holds them). With `fwd`, the forward of `req` that
    this vLLM request is: the prompt's length, the continuations it scores, its branch row, whether
    it is the first, and its own length (the prompt and the continuation's inputs past it)."""
    f = fwd or Forward(tuple(req.tokens), tuple(range(len(req.continuations))), len(req.tokens), True)
    return [
        tag,
        [len(req.tokens), list(f.scores), int(f.branch), bool(f.first), len(f.tokens)],
        [int(a) for a in req.answers],
        int(req.top_k),
        list(req.capture),
        [[p.site, p.layer, p.source, None if p.positions is None else [int(x) for x in p.positions], p.head,
          p.neuron, bool(p.whole)] for p in req.patches],
        [[[int(x) for x in z.positions], float(z.std), int(z.seed)] for z in req.noise],
        None if req.start is None else [int(req.start.layer), req.start.source],
        [[int(t) for t in c] for c in req.continuations],
        req.reference,
        bool(req.logprobs),
        bool(req.ranks),
        None if req.circuit is None else [req.circuit.source, [int(e) for e in req.circuit.kept]],
        None if req.knockout is None else [[int(x) for x in xs] for xs in (req.knockout.layers, req.knockout.queries,
                                                                             req.knockout.keys)],
    ]


class WirePlan(NamedTuple):
    """A plan as it travels (to_wire's list), its fields named; what the worker reads per request
    without building the Request (from_wire does that)."""

    tag: str
    forward: list  # [prompt length, continuations scored, branch row, first, its length]
    answers: list[int]
    top_k: int
    capture: list[str]
    patches: list[list]  # Patch's fields, in order
    noise: list[list]  # [positions, std, seed]
    start: list | None  # [layer, source]
    continuations: list[list[int]]
    reference: str | None
    logprobs: bool
    ranks: bool
    circuit: list | None  # [source, kept edge indices]
    knockout: list | None  # [layers, queries, keys]

    reads_vocabulary = property(Request.reads_vocabulary.fget)  # Request's own definition


def from_wire(plan: list) -> tuple[str, Request, tuple[int, Forward]]:
    """(tag, the request without its tokens, (prompt length, the forward without its tokens))."""
    w = WirePlan(*plan)
    req = Request(
        tokens=(),
        answers=tuple(w.answers),
        patches=tuple(Patch(s, l, src, None if pos is None else tuple(pos), h, u, wh)
                      for s, l, src, pos, h, u, wh in w.patches),
        noise=tuple(Noise(tuple(pos), std, seed) for pos, std, seed in w.noise),
        capture=tuple(w.capture),
        top_k=w.top_k,
        start=None if w.start is None else Start(*w.start),
        continuations=tuple(tuple(c) for c in w.continuations),
        reference=w.reference,
        logprobs=w.logprobs,
        ranks=w.ranks,
        circuit=None if w.circuit is None else Circuit(w.circuit[0], tuple(w.circuit[1])),
        knockout=None if w.knockout is None else Knockout(*(tuple(xs) for xs in w.knockout)),
    )
    n_prompt, scores, branch, first, _ = w.forward
    return w.tag, req, (n_prompt, Forward((), tuple(scores), branch, first))


# ---- tensors as plain data: collective_rpc crosses a process boundary in multiprocess mode ----

def encode_tensor(t: torch.Tensor) -> list:
    import torch

    t = t.detach().contiguous().cpu()
    dtype = str(t.dtype).removeprefix("torch.")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return [dtype, list(t.shape), raw.numpy().tobytes()]


def decode_tensor(enc) -> torch.Tensor:
    import torch

    dtype, shape, data = enc
    if not data:  # an empty tensor (torch.frombuffer refuses an empty buffer)
        return torch.empty(shape, dtype=getattr(torch, dtype))
    if dtype == "bfloat16":
        return torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)
