"""How a request runs as forwards: one per continuation of several tokens, over one tree of rows
(the prompt's positions, then each such continuation's inputs past it), joined back into one Result."""
from __future__ import annotations

from ..frozen import frozen
from .request import Request, Result


@frozen
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
    if all(len(c) == 1 for c in req.continuations):  # a grid's run: one forward scores them all
        return [Forward(tuple(req.tokens), tuple(range(len(req.continuations))), n, True)]
    single = tuple(j for j, c in enumerate(req.continuations) if len(c) == 1)
    longer = [j for j, c in enumerate(req.continuations) if len(c) > 1]
    out, branch = [], n
    for k, j in enumerate(longer):
        c = req.continuations[j]
        out.append(Forward(tuple(req.tokens) + tuple(c[:-1]), (j,) + (single if k == 0 else ()), branch, k == 0))
        branch += len(c) - 1
    return out


def call_forwards(requests) -> list[list[Forward]]:
    """Each request's forwards (`forwards`), made once for the requests with the same tokens and
    continuations (a grid's runs of a pair): those share one list, which no caller changes."""
    made: dict = {}
    out = []
    for r in requests:
        key = (r.tokens, r.continuations)
        try:
            fs = made.get(key)
        except TypeError:  # tokens given as a list (a request built by hand): made for it alone
            key = fs = None
        if fs is None:
            fs = forwards(r)
            if key is not None:
                made[key] = fs
        out.append(fs)
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
    import torch  # here, not at the top: the light commands import the plan and need no torch

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
        answer_logits=_float32(first["answer_logits"]),
        logsumexp=None if first["logsumexp"] is None else float(first["logsumexp"]),
        top_ids=list(first["top_ids"]), top_logits=list(first["top_logits"]),
        captures=captures, answer_ranks=list(first["answer_ranks"]),
        continuation_logprobs=[list(scores[j]) for j in range(len(req.continuations))],
        kl=first["kl"], logprobs=first["logprobs"])


def _float32(values):
    """A part's answer logits as a float32 tensor [answers]: a tensor as it is (its device kept); a
    list (vLLM's worker sends numbers) through numpy, a quarter of torch.as_tensor's cost per run."""
    import numpy as np
    import torch

    if isinstance(values, torch.Tensor):
        return values.to(torch.float32).reshape(-1)
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1))


def resolve_positions(p_positions, n: int) -> list[int]:
    return list(range(n)) if p_positions is None else [int(x) for x in p_positions]


def patch_rows(positions, whole: bool, n_prompt: int, n_tokens: int, branch: int) -> tuple[list[int], list[int]]:
    """(the positions of a forward a patch writes, the rows of its source they take), from the patch's
    `positions` and `whole` (Patch's fields): prompt positions, each from the same row; or with
    `whole` every position of the forward (`n_tokens` long, its answer inputs stored from tree row
    `branch` on) from its row of the tree."""
    if not whole:
        pos = resolve_positions(positions, n_prompt)
        return pos, pos
    return list(range(n_tokens)), tree_rows(Forward((0,) * n_tokens, (), branch, True), n_prompt)
