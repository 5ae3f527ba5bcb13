"""A call's readings, kept by plan (the k of request.request_id) in arrays: the readout writes each
step's numbers into them with one indexed assignment per kind of number, not a dictionary per
request, and `pg_end` returns them once (`wire`); the host reads every request's Result from them
(backends.vllm). What few runs read beyond them (captures, top_k, the last position's
log-probabilities) travels as the forward's own part, keyed by its tag (its plan index, as text).

    answers   [plans, most answers] float32   the answers' logits at the last prompt position
    ranks     [plans, most answers] int64      their ranks over the vocabulary (where read)
    lse, kl   [plans] float64                  logsumexp of those logits, KL from the reference (where read)
    done      [plans] bool                     the forward finished in this call
    scores    [slots] float64                  every continuation token's log-probability, a forward's
                                               continuations (in its plan's order) from score_start[k] on
    filled    [slots] bool                     each slot written
"""
from __future__ import annotations

import numpy as np
import torch

from ...plan import decode_tensor, encode_tensor

ARRAYS = ("answers", "ranks", "lse", "kl", "done", "score_start", "scores", "filled")


class CallResults:
    """One call's arrays (the table above), sized by its plans' answer ids [plans, most answers] (0 past
    a plan's own: columns.Columns.answer_ids), which the readout reads the logits of."""

    def __init__(self, answer_ids: np.ndarray):
        n, width = answer_ids.shape
        self.answer_ids = answer_ids
        self.answers = np.zeros((n, width), dtype=np.float32)
        self.ranks = np.zeros((n, width), dtype=np.int64)
        self.lse = np.zeros(n)
        self.kl = np.zeros(n)
        self.done = np.zeros(n, dtype=bool)
        self.score_start = np.zeros(n, dtype=np.int64)
        self.scores = np.zeros(max(n, 1))
        self.filled = np.zeros(max(n, 1), dtype=bool)
        self.slots = 0  # score slots handed out
        self.parts: dict[str, dict] = {}  # tag -> a forward's captures, top_k and log-probabilities

    def take(self, k: int, count: int) -> int:
        """`count` score slots for plan k's continuation tokens: the first one's index."""
        first = self.slots
        self._hold(first + count)
        self.score_start[k] = first
        return first

    def hand_out(self, starts: np.ndarray, total: int) -> None:
        """Every plan's score slots at once: plan k's from `starts[k]` on, `total` in all (columns.Columns)."""
        self._hold(total)
        self.score_start[:] = starts

    def _hold(self, slots: int) -> None:
        self.slots = slots
        if slots > len(self.scores):
            grow = max(slots, 2 * len(self.scores))
            self.scores = np.concatenate([self.scores, np.zeros(grow - len(self.scores))])
            self.filled = np.concatenate([self.filled, np.zeros(grow - len(self.filled), dtype=bool)])

    def finished(self, k: int, tag: str, part: dict | None) -> None:
        self.done[k] = True
        if part:
            self.parts[tag] = part

    def wire(self) -> dict:
        """As plain data (msgpack across a process boundary): each array a tensor's encoding
        (plan.encode_tensor), the score slots as far as they were handed out."""
        arrays = {name: getattr(self, name) for name in ARRAYS}
        arrays["scores"], arrays["filled"] = self.scores[:self.slots], self.filled[:self.slots]
        return {"arrays": {name: encode_tensor(torch.from_numpy(a)) for name, a in arrays.items()}, "parts": self.parts}


def decoded(wired: dict) -> dict[str, np.ndarray]:
    """`CallResults.wire()`'s arrays, as numpy arrays again."""
    return {name: decode_tensor(wired["arrays"][name]).numpy() for name in ARRAYS}
