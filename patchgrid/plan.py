"""What one engine request asks for, checked before anything runs.

A request is one forward pass over `tokens`. It may
- overwrite sites with values captured earlier from another prompt (`patches`, read from the
  `sources` handed to the engine call, by source name and site key),
- add seeded Gaussian noise to the embedding output at given positions (`noise`),
- capture sites over all positions (`capture`, site keys such as `resid.3`), recorded after
  this request's own patches are applied,
- read the logits (and ranks) of `answers` at the last prompt position, and the top `top_k` tokens,
- score `continuations` after the prompt, teacher-forced: each continuation's log-probability
  token by token (one forward per continuation of several tokens; prompt + its tokens but the last),
- measure the KL divergence at the last prompt position from the log-probabilities a source holds
  (`reference`, its `LOGPROBS` entry), and return its own (`logprobs`),
- say where it may start (`start`): when everything below a layer computes exactly what a cached
  run computed, an engine may begin the forward at that layer from the run's stream instead of
  recomputing it. The result is the same either way; the reference backend always runs it all.

Patches and noise address prompt positions only (a `whole` patch: every row of the request). A request whose continuations have several
tokens runs as several forwards (`forwards`), which agree on the prompt (attention is causal);
its captures and start streams cover them all in one "tree" of rows: the prompt's positions, then
each such continuation's inputs past the prompt in turn (`tree_len`).
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

import torch

from .sites import LAYER_SITES, SITE_KINDS, SITES, ModelShape, parse_key, site_key


class PlanError(ValueError):
    """A request that cannot run as asked; the message names the field."""


@dataclass(frozen=True)
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

    @property
    def key(self) -> str:
        return site_key(self.site, self.layer)

    @property
    def unit(self) -> int | None:
        """The head or neuron patched alone; None: the site's whole width."""
        return self.head if self.head is not None else self.neuron


@dataclass(frozen=True)
class Noise:
    positions: tuple[int, ...]
    std: float
    seed: int


@dataclass(frozen=True)
class Start:
    """Below `layer` this request computes exactly what the cached run `source` computed (same
    tokens, same noise, no patch there), so its forward may begin at `layer` with `source`'s stream
    entering that layer (`stream_key(layer)`). Patches on that stream are written into it."""

    layer: int
    source: str

    @property
    def key(self) -> str:
        return stream_key(self.layer)


def stream_key(layer: int) -> str:
    """The site key of the whole stream entering `layer` (>= 1): the previous layer's output."""
    return site_key("resid", layer - 1)


LOGPROBS = "logprobs"  # a source's entry holding a run's log-probabilities at its last prompt position [vocab]


@dataclass(frozen=True)
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


@dataclass
class Result:
    answer_logits: torch.Tensor  # [len(answers)] float32
    logsumexp: float  # of the last prompt position's logits, so p(answer) = exp(logit - logsumexp)
    top_ids: list[int] = field(default_factory=list)
    top_logits: list[float] = field(default_factory=list)
    captures: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> [tree_len, width]
    answer_ranks: list[int] = field(default_factory=list)  # per answer: tokens with a larger logit
    continuation_logprobs: list[list[float]] = field(default_factory=list)  # per continuation, per token
    kl: float | None = None  # KL(reference || this run) at the last prompt position, when asked
    logprobs: torch.Tensor | None = None  # [vocab] float32, when asked

    @property
    def answer_probs(self) -> torch.Tensor:
        return torch.exp(self.answer_logits - self.logsumexp)


@dataclass(frozen=True)
class Forward:
    """One forward pass of a request: the prompt and the inputs of at most one continuation."""

    tokens: tuple[int, ...]
    scores: tuple[int, ...]  # the continuations (indices) it scores
    branch: int  # the tree row its first position past the prompt is stored at
    first: bool  # reads the last prompt position's logits (answers, ranks, KL, top_k, logprobs)


def forwards(req: Request) -> list[Forward]:
    """The forwards `req` takes: one per continuation of several tokens (the prompt followed by its
    tokens but the last, each of which the position before predicts), or one over the prompt; the
    one-token continuations are scored at the last prompt position of the first."""
    n = len(req.tokens)
    single = tuple(j for j, c in enumerate(req.continuations) if len(c) == 1)
    longer = [j for j, c in enumerate(req.continuations) if len(c) > 1]
    if not longer:
        return [Forward(tuple(req.tokens), single, n, True)]
    out, branch = [], n
    for k, j in enumerate(longer):
        c = req.continuations[j]
        out.append(Forward(tuple(req.tokens) + tuple(c[:-1]), (j,) + (single if k == 0 else ()), branch, k == 0))
        branch += len(c) - 1
    return out


def tree_len(req: Request) -> int:
    """Rows of the request's captures: its prompt, then every continuation's inputs past it."""
    return len(req.tokens) + sum(len(c) - 1 for c in req.continuations)


def tree_rows(fwd: Forward, n_prompt: int) -> list[int]:
    """The tree row of each of a forward's positions."""
    return list(range(n_prompt)) + list(range(fwd.branch, fwd.branch + len(fwd.tokens) - n_prompt))


def join_forwards(req: Request, fwds: list[Forward], parts: list[dict]) -> Result:
    """A request's Result from its forwards' parts: each part has `captures` {key: [positions,
    width]} and `scores` {continuation: [log-probabilities]}; the first has the last prompt
    position's readings (`answer_logits`, `logsumexp`, `top_ids`, `top_logits`, `answer_ranks`,
    `kl`, `logprobs`)."""
    n = len(req.tokens)
    first = parts[0]
    captures = {}
    for key in req.capture:
        rows = [parts[0]["captures"][key][:n]] + [p["captures"][key][n:] for p in parts]
        captures[key] = torch.cat(rows) if len(parts) > 1 else parts[0]["captures"][key]
    scores = {}
    for p in parts:
        scores.update(p["scores"])
    missing = [j for j in range(len(req.continuations)) if j not in scores or None in scores[j]]
    if missing:
        raise RuntimeError(f"continuation {missing[0]} of a request was not scored in full")
    return Result(
        answer_logits=torch.as_tensor(first["answer_logits"], dtype=torch.float32).reshape(-1),
        logsumexp=float(first["logsumexp"]), top_ids=list(first["top_ids"]), top_logits=list(first["top_logits"]),
        captures=captures, answer_ranks=list(first["answer_ranks"]),
        continuation_logprobs=[list(scores[j]) for j in range(len(req.continuations))],
        kl=first["kl"], logprobs=first["logprobs"])


def gaussian_noise(noise: Noise, width: int) -> torch.Tensor:
    """[len(positions), width] float32, the same on every backend and machine for a seed."""
    g = torch.Generator().manual_seed(int(noise.seed))
    return torch.randn(len(noise.positions), width, generator=g, dtype=torch.float32) * float(noise.std)


def trace_seed(seed: int, pair_id: str, sample: int) -> int:
    """The noise seed of causal-tracing sample `sample` of a pair, under a study's seed."""
    return zlib.crc32(f"{seed}:{pair_id}:{sample}".encode())


def validate(requests, sources, shape: ModelShape) -> None:
    """Refuse any out-of-range plan before anything runs."""
    for i, req in enumerate(requests):
        where = f"request {i}"
        n = len(req.tokens)
        if n == 0:
            raise PlanError(f"{where}: tokens is empty")
        if n > shape.max_len:
            raise PlanError(f"{where}: tokens has {n} tokens, more than the model's {shape.max_len}")
        for t in req.tokens:
            if not 0 <= int(t) < shape.vocab_size:
                raise PlanError(f"{where}: token id {t} is outside the vocabulary (0..{shape.vocab_size - 1})")
        for a in req.answers:
            if not 0 <= int(a) < shape.vocab_size:
                raise PlanError(f"{where}: answer id {a} is outside the vocabulary (0..{shape.vocab_size - 1})")
        if req.top_k < 0:
            raise PlanError(f"{where}: top_k {req.top_k} is negative")
        for j, c in enumerate(req.continuations):
            if not c:
                raise PlanError(f"{where}: continuation {j} is empty")
            for t in c:
                if not 0 <= int(t) < shape.vocab_size:
                    raise PlanError(f"{where}: continuation {j} token id {t} is outside the vocabulary "
                                    f"(0..{shape.vocab_size - 1})")
            if n + len(c) - 1 > shape.max_len:
                raise PlanError(f"{where}: continuation {j} has {len(c)} tokens; after the {n}-token prompt that "
                                f"is more than the model's {shape.max_len}")
        if req.reference is not None:
            ref = sources.get(req.reference, {}).get(LOGPROBS)
            if ref is None:
                raise PlanError(f"{where}: reference source {req.reference!r} holds no {LOGPROBS}")
            if ref.dim() != 1 or ref.shape[0] != shape.vocab_size:
                raise PlanError(f"{where}: reference {req.reference!r} {LOGPROBS} has shape {tuple(ref.shape)}, "
                                f"expected [{shape.vocab_size}]")
        for key in req.capture:
            try:
                site, layer = parse_key(key)
            except ValueError as exc:
                raise PlanError(f"{where}: capture {exc}") from None
            _check_layer(where, "capture", layer, shape)
            _check_family(where, site, shape)
        for p in req.patches:
            _check_patch(where, p, req, sources, shape)
        for z in req.noise:
            _check_positions(where, "noise.positions", z.positions, n)
            if not z.std >= 0:
                raise PlanError(f"{where}: noise.std {z.std} must be >= 0")
        if req.start is not None:
            _check_start(where, req, sources, shape)


def _check_start(where, req: Request, sources, shape: ModelShape):
    s = req.start
    # The last layer must run: the final norm needs a layer's output to read.
    if not 1 <= s.layer < shape.n_layers:
        raise PlanError(f"{where}: start layer {s.layer} is out of range (1..{shape.n_layers - 1}: at least "
                        "one layer is skipped and one runs)")
    if s.source not in sources:
        raise PlanError(f"{where}: start source {s.source!r} is not among the call's sources")
    src = sources[s.source].get(s.key)
    if src is None:
        raise PlanError(f"{where}: start source {s.source!r} holds no {s.key}, the stream entering layer {s.layer}")
    if src.dim() != 2 or src.shape[1] != shape.d_model or src.shape[0] < tree_len(req):
        raise PlanError(f"{where}: start source {s.source!r} {s.key} has shape {tuple(src.shape)}, expected "
                        f"[{tree_len(req)}, {shape.d_model}] (the prompt and its continuations' inputs)")
    for p in req.patches:
        if not _at_or_above(p.site, p.layer, s.layer):
            raise PlanError(f"{where}: patch {p.key} lies below start layer {s.layer}, which skips it")
    for key in req.capture:
        if not _at_or_above(*parse_key(key), s.layer):
            raise PlanError(f"{where}: capture {key} lies below start layer {s.layer}, which skips it")


def latest_start(patches, n_layers: int) -> int:
    """The latest layer a forward with these patches can start at (0: it must run them all): the
    stream entering layer L+1 already holds a patch on layer L's output; other sites at L (the
    stream entering L among them: it is written after the start) need layer L to run; the last
    layer always runs."""
    starts = [0 if p.site == "embed" else p.layer + 1 if p.site == "resid" else p.layer for p in patches]
    return min(starts + [n_layers - 1])


def _at_or_above(site: str, layer: int | None, start: int) -> bool:
    """Whether a site is computed (or, for the stream entering `start`, written) when the forward
    begins at `start`."""
    if site == "embed":
        return False
    return layer >= start or (site == "resid" and layer == start - 1)


def _check_family(where, site: str, shape: ModelShape) -> None:
    why = shape.family.missing(site)
    if why:
        raise PlanError(f"{where}: site {site}: {why}")


def _check_layer(where, field_name, layer, shape):
    if layer is not None and not 0 <= layer < shape.n_layers:
        raise PlanError(f"{where}: {field_name} layer {layer} is out of range (model has {shape.n_layers} layers)")


def _check_positions(where, field_name, positions, n):
    for pos in positions:
        if not 0 <= int(pos) < n:
            raise PlanError(f"{where}: {field_name} position {pos} is out of range (prompt has {n} tokens)")


def _check_patch(where, p: Patch, req: Request, sources, shape: ModelShape):
    n = len(req.tokens)
    if p.site not in SITE_KINDS:
        raise PlanError(f"{where}: patch site {p.site!r} is unknown; use one of {', '.join(SITE_KINDS)}")
    if p.site in LAYER_SITES:
        if p.layer is None:
            raise PlanError(f"{where}: patch layer is missing for site {p.site}")
        _check_layer(where, "patch", p.layer, shape)
    site = SITES[p.site]
    _check_family(where, p.site, shape)
    if not site.patchable:
        raise PlanError(f"{where}: site {p.site} can be captured, not patched")
    for field_name in ("head", "neuron"):
        index = getattr(p, field_name)
        if site.unit_field == field_name:
            what = "key/value head" if site.unit == "kv_head" else site.unit
            if index is None or not 0 <= index < shape.units(p.site):
                raise PlanError(f"{where}: patch {field_name} {index} is out of range (model has {shape.units(p.site)} "
                                f"{what}s per layer)")
        elif index is not None:
            raise PlanError(f"{where}: patch {field_name} is set for site {p.site}, which has no {field_name}s")
    if p.whole and (p.positions is not None or site.unit is not None):
        raise PlanError(f"{where}: patch {p.key} is whole (every row of the request): it takes no positions and "
                        "no unit")
    if p.positions is not None:
        _check_positions(where, "patch.positions", p.positions, n)
    if p.source not in sources:
        raise PlanError(f"{where}: patch source {p.source!r} is not among the call's sources")
    src = sources[p.source].get(p.key)
    if src is None:
        raise PlanError(f"{where}: patch source {p.source!r} holds no {p.key}")
    if src.dim() != 2 or src.shape[1] != shape.width(p.site):
        raise PlanError(f"{where}: patch source {p.source!r} {p.key} has shape {tuple(src.shape)}, "
                        f"expected [tokens, {shape.width(p.site)}]")
    needed = tree_len(req) if p.whole else n if p.positions is None else max(p.positions) + 1
    if src.shape[0] < needed:
        raise PlanError(f"{where}: patch source {p.source!r} {p.key} has {src.shape[0]} positions, "
                        f"the patch needs {needed}")


def resolve_positions(p_positions, n: int) -> list[int]:
    return list(range(n)) if p_positions is None else [int(x) for x in p_positions]


def patch_rows(p: Patch, n_prompt: int, n_tokens: int, branch: int) -> tuple[list[int], list[int]]:
    """(the positions of a forward a patch writes, the rows of its source they take): prompt
    positions, each from the same row; or with `whole` every position of the forward (`n_tokens`
    long, its answer inputs stored from tree row `branch` on) from its row of the tree."""
    if not p.whole:
        pos = resolve_positions(p.positions, n_prompt)
        return pos, pos
    return list(range(n_tokens)), tree_rows(Forward((0,) * n_tokens, (), branch, True), n_prompt)


# ---- a plan as plain data, for SamplingParams.extra_args (msgpack in multiprocess mode) ----

def to_wire(req: Request, tag: str, fwd: Forward | None = None) -> str:
    """One JSON string: vLLM deep-copies and checks extra_args per request, and a string is cheap
    to copy and crosses msgpack as it is. With `fwd`, the forward of `req` that this vLLM request
    is: the prompt's length, the continuations it scores, its branch row and whether it is the first."""
    f = fwd or Forward(tuple(req.tokens), tuple(range(len(req.continuations))), len(req.tokens), True)
    return json.dumps([
        tag,
        [len(req.tokens), list(f.scores), int(f.branch), bool(f.first)],
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
    ], separators=(",", ":"))


def from_wire(text: str) -> tuple[str, Request, tuple[int, Forward]]:
    """(tag, the request without its tokens, (prompt length, the forward without its tokens))."""
    tag, fwd, answers, top_k, capture, patches, noise, start, continuations, reference, logprobs = json.loads(text)
    req = Request(
        tokens=(),
        answers=tuple(answers),
        patches=tuple(Patch(s, l, src, None if pos is None else tuple(pos), h, u, w)
                      for s, l, src, pos, h, u, w in patches),
        noise=tuple(Noise(tuple(pos), std, seed) for pos, std, seed in noise),
        capture=tuple(capture),
        top_k=top_k,
        start=None if start is None else Start(*start),
        continuations=tuple(tuple(c) for c in continuations),
        reference=reference,
        logprobs=logprobs,
    )
    n_prompt, scores, branch, first = fwd
    return tag, req, (n_prompt, Forward((), tuple(scores), branch, first))


# ---- tensors as plain data: collective_rpc crosses a process boundary in multiprocess mode ----

def encode_tensor(t: torch.Tensor) -> list:
    t = t.detach().contiguous().cpu()
    dtype = str(t.dtype).removeprefix("torch.")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return [dtype, list(t.shape), raw.numpy().tobytes()]


def decode_tensor(enc) -> torch.Tensor:
    dtype, shape, data = enc
    if dtype == "bfloat16":
        return torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)
