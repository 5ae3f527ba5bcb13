"""One vLLM request as the worker sees it: its plan, read from its SamplingParams, and what it
gathers across scheduler steps.

A patchgrid request whose answers are scored whole is several vLLM requests, one per forward
(plan.forwards): the prompt followed by one continuation's inputs. Patches and noise address the
prompt's positions only. Plans travel as plain data (`plan.to_wire`) under `PLAN_KEY` in
`SamplingParams.extra_args`; the values they patch in are the call's sources, held in the worker
and named by the plan.
"""
from __future__ import annotations

import numpy as np
import torch

from ...plan import Forward, Noise, encode_tensor, from_wire, gaussian_noise, patch_rows, tree_rows
from ...sites import SITES, parse_key
from ...tp import unit_owner

PLAN_KEY = "patchgrid"


def plan_of(state) -> str | None:
    """The patchgrid plan a vLLM request (the runner's state of it) carries (None: a request of no
    patchgrid call)."""
    extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
    return extra.get(PLAN_KEY)


class Request:
    """One vLLM request (a forward of a patchgrid request, plan.forwards): its plan and what it has
    gathered so far, kept across scheduler steps."""

    def __init__(self, plan: str, n_tokens: int, sources, references, widths, dtype, tp=(0, 1)):
        self.tag, req, (n_prompt, fwd) = from_wire(plan)
        self.answers = list(req.answers)
        self.top_k = req.top_k
        self.n_prompt = n_prompt  # patches and noise address the prompt's positions
        self.n_tokens = n_tokens  # the prompt and one continuation's inputs
        self.first = fwd.first
        self.logprobs = req.logprobs
        self.reference = None if req.reference is None else references[req.reference]
        # (continuation index, its tokens): position n_prompt - 1 + k predicts token k
        self.scores = [(j, list(req.continuations[j])) for j in fwd.scores]
        self.scored = {j: [None] * len(c) for j, c in self.scores}
        self.readout: dict = {}
        # (key, unit (head or neuron) within this rank's slice or None, positions array,
        # values [len(positions), w])
        self.patches = []
        rank, tp_size = tp
        for p in req.patches:
            unit = p.unit
            if unit is not None:
                owner, unit = unit_owner(p.unit, widths["units"][SITES[p.site].unit], tp_size)
                if owner != rank:  # another rank holds this head's slice of z, or this neuron
                    continue
            pos, rows = patch_rows(p, n_prompt, n_tokens, fwd.branch)
            pos = np.asarray(pos, dtype=np.int64)
            vals = sources[p.source][p.key][torch.tensor(rows, dtype=torch.long)]
            if p.unit is not None:
                uw = widths["unit_width"][SITES[p.site].unit]
                vals = vals[:, p.unit * uw:(p.unit + 1) * uw]
            self.patches.append((p.key, unit, pos, vals))
        self.noise = []
        for z in req.noise:
            pos = np.asarray(z.positions, dtype=np.int64)
            self.noise.append((pos, gaussian_noise(Noise(tuple(pos), z.std, z.seed), widths["d_model"]).to(dtype)))
        self.captures = {key: torch.empty(n_tokens, widths[parse_key(key)[0]], dtype=dtype) for key in req.capture}
        self.start = req.start
        # the cached stream entering the start layer, one row per position of this forward
        self.start_rows = None
        if req.start is not None:
            # the stream source holds the request's tree of rows: this forward's are its own
            rows = torch.tensor(tree_rows(Forward((0,) * n_tokens, (), fwd.branch, fwd.first), n_prompt))
            self.start_rows = sources[req.start.source][req.start.key][rows]

    def part(self) -> dict:
        """What this forward gives its request (plan.join_forwards), as plain data."""
        return {**self.readout, "scores": self.scored,
                "captures": {key: encode_tensor(v) for key, v in self.captures.items()}}
