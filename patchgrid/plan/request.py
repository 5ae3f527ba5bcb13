"""What a request asks for (its patches, noise and start) and the result it gets back."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING

from ..frozen import frozen
from ..model.sites import site_key

if TYPE_CHECKING:  # torch is imported where it is used: the light commands import the plan and need no torch
    import torch


@frozen
class Patch:
    site: str
    layer: int | None  # None only for embed
    source: str  # name of a capture in the call's `sources`
    positions: tuple[int, ...] | None = None  # None: every position
    head: int | None = None  # for the sites patched by head: head, q (query heads), k and v (key/value heads)
    neuron: int | None = None  # only for site == "neuron"
    # Every row of every forward the request takes: the prompt and the answers' inputs past it, read
    # from the source's rows of the same tree (tree_len); positions must be None. What holds a site
    # at another run's values wherever the request computes it (path patching's freezes).
    whole: bool = False

    @cached_property
    def key(self) -> str:
        """Its site key (read several times per run: kept once made)."""
        return site_key(self.site, self.layer)

    @property
    def unit(self) -> int | None:
        """The head or neuron patched alone; None: the site's whole width."""
        return self.head if self.head is not None else self.neuron


@frozen
class Noise:
    positions: tuple[int, ...]
    std: float
    seed: int


@frozen
class Start:
    """Below `layer` this request computes exactly what the cached run `source` computed (same
    tokens, same noise, no patch there), so its forward may begin at `layer` with `source`'s stream
    entering that layer (`stream_key(layer)`). Patches on that stream are written into it."""

    layer: int
    source: str

    @property
    def key(self) -> str:
        return stream_key(self.layer)


@frozen
class Circuit:
    """An edge-level intervention (patchgrid.methods.graph's edges; backends.edge_ablation computes it): the
    request runs its own tokens, and every edge outside the circuit carries its sender's output from
    `source` instead of this run's; the edges in `kept` (indices into EdgeGraph.edges) carry this
    run's. The source holds each sender's output: resid_pre.0, head.L (z) and mlp_out.L."""

    source: str
    kept: tuple[int, ...] = ()


@frozen
class Knockout:
    """Attention knockout (Geva et al. 2023): at each of `layers`, every head's attention from the
    prompt positions `queries` to the prompt positions `keys` is blocked, its scores set to minus
    infinity before the softmax, so those keys get weight exactly 0 and the rest renormalise. The
    heads' outputs at the query positions are recomputed from this run's own q, k and v
    (backends.patterns.attend); keys and values, and so what later positions read, are unchanged."""

    layers: tuple[int, ...]
    queries: tuple[int, ...]
    keys: tuple[int, ...]


def stream_key(layer: int) -> str:
    """The site key of the whole stream entering `layer` (>= 1): the previous layer's output."""
    return site_key("resid", layer - 1)


LOGPROBS = "logprobs"  # a source's entry holding a run's log-probabilities at its last prompt position [vocab]


@frozen
class Request:
    tokens: tuple[int, ...]
    answers: tuple[int, ...] = ()
    patches: tuple[Patch, ...] = ()
    noise: tuple[Noise, ...] = ()
    capture: tuple[str, ...] = ()
    top_k: int = 0
    start: Start | None = None  # None: from the embedding
    continuations: tuple[tuple[int, ...], ...] = ()
    reference: str | None = None  # the source whose LOGPROBS the KL divergence is measured from
    logprobs: bool = False  # return the last prompt position's log-probabilities
    ranks: bool = True  # read the answers' ranks over the vocabulary
    circuit: Circuit | None = None  # an edge-level intervention (a circuit run)
    knockout: Knockout | None = None  # attention edges blocked (an attention knockout)

    @property
    def reads_vocabulary(self) -> bool:
        """Whether its readout needs the whole vocabulary's logits at a read row (its logsumexp):
        False when it reads only its answers' logits at the last prompt position, which need
        only those columns of the unembedding."""
        return bool(self.continuations or self.reference is not None or self.ranks or self.top_k or self.logprobs)


_REQUEST_FIELDS = frozenset(f.name for f in fields(Request))


def replaced(req: Request, **changes) -> Request:
    """dataclasses.replace(req, **changes) at a fifth of its cost (a grid makes one per run): a
    Request's fields are its instance dictionary and its __init__ only sets them (it has no
    __post_init__), so the copy is its dictionary with the changes, as copy.copy makes one."""
    unknown = changes.keys() - _REQUEST_FIELDS
    if unknown:
        raise TypeError(f"Request has no field {sorted(unknown)[0]}")
    new = object.__new__(Request)
    new.__dict__.update(req.__dict__)
    new.__dict__.update(changes)
    return new


@dataclass
class Result:
    answer_logits: torch.Tensor  # [len(answers)] float32
    # of the last prompt position's logits, so p(answer) = exp(logit - logsumexp); None: the request
    # read only its answers' logits (Request.reads_vocabulary)
    logsumexp: float | None
    top_ids: list[int] = field(default_factory=list)
    top_logits: list[float] = field(default_factory=list)
    captures: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> [tree_len, width]
    answer_ranks: list[int] = field(default_factory=list)  # per answer: tokens with a larger logit (when asked)
    continuation_logprobs: list[list[float]] = field(default_factory=list)  # per continuation, per token
    kl: float | None = None  # KL(reference || this run) at the last prompt position, when asked
    logprobs: torch.Tensor | None = None  # [vocab] float32, when asked

    @property
    def answer_probs(self) -> torch.Tensor:
        import torch

        if self.logsumexp is None:
            raise ValueError("this result read only its answers' logits (Request.reads_vocabulary): it has no "
                             "logsumexp, so no probabilities")
        return torch.exp(self.answer_logits - self.logsumexp)



def gaussian_noise(noise: Noise, width: int) -> torch.Tensor:
    """[len(positions), width] float32, the same on every backend and machine for a seed."""
    import torch

    g = torch.Generator().manual_seed(int(noise.seed))
    return torch.randn(len(noise.positions), width, generator=g, dtype=torch.float32) * float(noise.std)


def trace_seed(seed: int, pair_id: str, sample: int) -> int:
    """The noise seed of causal-tracing sample `sample` of a pair, under a study's seed."""
    return zlib.crc32(f"{seed}:{pair_id}:{sample}".encode())


def latest_start(patches, n_layers: int, knockout: Knockout | None = None) -> int:
    """The latest layer a forward with these patches (and knockout) can start at (0: it must run them
    all): the stream entering layer L+1 already holds a patch on layer L's output; other sites at L
    (the stream entering L among them: it is written after the start) need layer L to run, as does a
    knockout's first layer; the last layer always runs."""
    starts = [0 if p.site == "embed" else p.layer + 1 if p.site == "resid" else p.layer for p in patches]
    return min(starts + list(knockout.layers if knockout else ()) + [n_layers - 1])


def recomputed_heads(req: Request) -> set[str]:
    """The site keys whose hooks a request's attention interventions need: at each layer where a
    head's output is recomputed (a pattern patch, a knockout), the attention (`pattern.L`: where q, k
    and v are read) and the heads' outputs (`head.L`: where the recomputed ones are written)."""
    layers = {p.layer for p in req.patches if p.site == "pattern"} | set(req.knockout.layers if req.knockout else ())
    return {f"{site}.{layer}" for layer in layers for site in ("pattern", "head")}
