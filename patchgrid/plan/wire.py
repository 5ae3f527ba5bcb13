"""Requests and tensors as plain data for vLLM's worker: a call's plans and tensors travel through
collective_rpc (msgpack across a process boundary in multiprocess mode), as lists, numbers, strings
and bytes.

A call's plans travel as columns (`to_columns`): what every plan holds as arrays by plan, its patches
and scored tokens as flat tables, so that neither side makes an object per plan; a plan that holds
more (noise, captures, pattern patches, a circuit, a knockout, top_k or log-probabilities) travels
whole besides (`to_wire`), under its plan index. Plan k is the k-th forward of the call's requests,
in order (backends.vllm_worker.request.request_id).

    n_prompt, n_tokens, branch  [plans]  the prompt's length, the forward's (the prompt and one
                                         continuation's inputs), the tree row its first position past
                                         the prompt is stored at (plan.tree_rows)
    first                       [plans]  its request's first forward (it reads the answers)
    start_layer                 [plans]  the layer it starts at (plan.Start), -1 from the embedding
    start_name, start_key       [plans]  the start stream's source and site key (-1: none)
    reference                   [plans]  its KL reference's source (-1: none)
    reads_vocabulary, ranked, extra  [plans]  Request.reads_vocabulary; it reads ranks; top_k or logprobs
    answers, n_answers          [plans, most answers], [plans]  its answer ids (0 past its own), how many
    patch_count                 [plans]  its patches (pattern patches apart: those travel whole)
    patch_name, patch_key, patch_unit, patch_npos   [patches]  a patch's source, site key, head or
                                         neuron (-1: the site's whole width), number of positions
    patch_pos                   [entries]  each patch's positions, one patch after another
    score_count                 [plans]  the continuation tokens it scores
    score_index, score_token    [scored]  a token's index in its continuation, and the token

Sources and site keys are numbers into `names` and `keys`.
"""
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


def to_columns(requests, fwds) -> dict:
    """A call's plans as columns (the module's table): `fwds` are the requests' forwards (plan.forwards).
    The rows of a patch's source a position reads are its tree rows (the prompt's positions, a
    continuation's inputs from `branch` on), which the worker derives."""
    import numpy as np

    names: dict[str, int] = {}
    keys: dict[str, int] = {}
    plan = {name: [] for name in ("n_prompt", "n_tokens", "branch", "first", "start_layer", "start_name", "start_key",
                                  "reference", "reads_vocabulary", "ranked", "extra", "n_answers", "patch_count",
                                  "score_count")}
    (n_prompt, n_tokens, branch, first, start_layer, start_name, start_key, reference, vocabulary, ranked, extra,
     n_answers, patch_count, score_count) = plan.values()
    flat = {name: [] for name in ("patch_name", "patch_key", "patch_unit", "patch_npos", "patch_pos", "score_index",
                                  "score_token")}
    patch_name, patch_key, patch_unit, patch_npos, patch_pos, score_index, score_token = flat.values()
    answers, special = [], []
    k = 0
    for r, fs in zip(requests, fwds):
        n = len(r.tokens)
        ref = -1 if r.reference is None else names.setdefault(r.reference, len(names))
        if r.start is None:
            start = (-1, -1, -1)
        else:
            start = (r.start.layer, names.setdefault(r.start.source, len(names)),
                     keys.setdefault(r.start.key, len(keys)))
        reads, wants_extra = r.reads_vocabulary, bool(r.top_k or r.logprobs)
        more = wants_extra or bool(r.noise or r.capture or r.circuit is not None or r.knockout is not None)
        for f in fs:
            length = len(f.tokens)
            n_prompt.append(n)
            n_tokens.append(length)
            branch.append(f.branch)
            first.append(f.first)
            start_layer.append(start[0])
            start_name.append(start[1])
            start_key.append(start[2])
            reference.append(ref)
            vocabulary.append(reads)
            ranked.append(r.ranks)
            extra.append(wants_extra)
            n_answers.append(len(r.answers))
            answers.append(r.answers)
            count = 0
            pattern = False
            for p in r.patches:
                if p.site == "pattern":  # recomputed in the attention hook: the plan travels whole
                    pattern = True
                    continue
                patch_name.append(names.setdefault(p.source, len(names)))
                patch_key.append(keys.setdefault(p.key, len(keys)))
                patch_unit.append(-1 if p.unit is None else p.unit)
                positions = range(length) if p.whole else range(n) if p.positions is None else p.positions
                patch_npos.append(len(positions))
                patch_pos.extend(positions)
                count += 1
            patch_count.append(count)
            scored = 0
            for j in f.scores:
                c = r.continuations[j]
                score_index.extend(range(len(c)))
                score_token.extend(c)
                scored += len(c)
            score_count.append(scored)
            if more or pattern:
                special.append([k, to_wire(r, str(k), f)])
            k += 1
    width = max(map(len, answers), default=0)
    if any(len(a) != width for a in answers):
        answers = [tuple(a) + (0,) * (width - len(a)) for a in answers]
    arrays = {name: np.array(values, dtype=np.int64) for name, values in {**plan, **flat}.items()}
    arrays["answers"] = np.array(answers, dtype=np.int64).reshape(k, width)
    return {"names": list(names), "keys": list(keys), "special": special,
            "arrays": {name: encode_array(a) for name, a in arrays.items()}}


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


def encode_array(a) -> list:
    """A numpy array as plain data (encode_tensor's form, without torch)."""
    return [str(a.dtype), list(a.shape), a.tobytes()]


def decode_array(enc):
    """encode_array's (or encode_tensor's, but bfloat16's) array, as a numpy array (read-only)."""
    import numpy as np

    dtype, shape, data = enc
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


def decode_tensor(enc) -> torch.Tensor:
    import torch

    dtype, shape, data = enc
    if not data:  # an empty tensor (torch.frombuffer refuses an empty buffer)
        return torch.empty(shape, dtype=getattr(torch, dtype))
    if dtype == "bfloat16":
        return torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)
