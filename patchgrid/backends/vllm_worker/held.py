"""The vLLM requests of a call as the worker sees them, and the call's sources, stacked per site key.

A patchgrid request whose answers are scored whole is several vLLM requests, one per forward
(plan.forwards): the prompt followed by one continuation's inputs. Patches and noise address the
prompt's positions only. A call's plans travel as plain data (`plan.to_columns`) with its sources,
once per call (`pg_begin`); each vLLM request's id names its plan (`request_id`), so that every
forward shares one SamplingParams. The values the plans patch in are the call's sources, held in
the worker and named by the plan: a plan names the rows of the stacked sources (`Sources`) each
patch reads, and the step gathers every value of a site key in one index (step.plan_step). What every
plan holds is read into the call's columns (columns.Columns); a `HeldRequest` here is a forward that
holds more (noise, captures, a circuit, pattern patches, a knockout, top_k or log-probabilities).
"""
from __future__ import annotations

import numpy as np
import torch

from ...model.sites import parse_key, site_key
from ...plan import LOGPROBS, Forward, Noise, WirePlan, decode_tensor, encode_tensor, gaussian_noise, tree_rows


def request_id(call: int, k: int) -> str:
    """The vLLM request id of forward `k` of engine call `call` (the k-th of its plans)."""
    return f"pg{call}.{k}"


def plan_indices(rids, call: int) -> list[int]:
    """Which of call `call`'s plans each vLLM request of `rids` runs (vLLM appends `-<random>` to the
    id it was given); -1: a request of no patchgrid call, or of another."""
    prefix = f"pg{call}."
    cut = len(prefix)
    out = []
    for rid in rids:
        given = rid.partition("-")[0]
        k = given[cut:]
        out.append(int(k) if given.startswith(prefix) and k.isdigit() else -1)
    return out


class Sources:
    """A call's sources (plain data from the host) decoded to the model's dtype, on the CPU, stacked
    per site key: `rows[key]` holds every source's rows of that key one source after another, and
    `first[(source, key)]` is the row its source's rows start at. A patch names its values as rows
    of the stack, so a step gathers all of a key's values in one index."""

    def __init__(self, wire: dict, dtype):
        per_key: dict[str, list] = {}
        held: dict[str, int] = {}  # rows stacked so far per key
        self.first: dict[tuple[str, str], int] = {}
        # patterns, unstacked (their width is the heads times their own prompt's length), in float32
        self.patterns: dict[tuple[str, str], torch.Tensor] = {}
        for name, caps in wire.items():
            for key, enc in caps.items():
                if key == LOGPROBS:
                    continue
                t = decode_tensor(enc)
                if parse_key(key)[0] == "pattern":
                    self.patterns[(name, key)] = t.float()
                    continue
                self.first[(name, key)] = held.get(key, 0)
                held[key] = self.first[(name, key)] + len(t)
                per_key.setdefault(key, []).append(t)
        self.rows = {key: (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dtype)
                     for key, parts in per_key.items()}


def tree(n_tokens: int, n_prompt: int, branch: int) -> list[int]:
    """The tree rows of a forward's positions (plan.tree_rows): its prompt's, then from `branch` on."""
    if n_tokens == n_prompt:
        return list(range(n_prompt))
    return tree_rows(Forward((0,) * n_tokens, (), branch, True), n_prompt)


class HeldRequest:
    """A forward (a vLLM request, plan.forwards) that holds more than the call's columns
    (columns.Columns): noise, captures, a circuit, pattern patches, a knockout, top_k or
    log-probabilities; and what it gathers of those across scheduler steps."""

    __slots__ = ("k", "tag", "n_prompt", "n_tokens", "top_k", "logprobs", "extra", "pattern_patches", "knockout",
                 "held_kv", "noise", "captures", "circuit", "ablated", "tree")

    def __init__(self, plan: list, sources: Sources, widths, dtype, *, k: int):
        """Plan `k` of the call (request_id), as it travels (plan.WirePlan)."""
        w = WirePlan(*plan)
        n_prompt, _, branch, _, n_tokens = w.forward
        self.k = k
        self.tag = w.tag
        self.n_prompt = n_prompt  # patches and noise address the prompt's positions
        self.n_tokens = n_tokens  # the prompt and one continuation's inputs
        self.top_k = w.top_k
        self.logprobs = w.logprobs
        self.extra = {}  # top_k's ids and logits, the log-probabilities (readout.read)
        # heads' outputs recomputed (hooks.SiteHooks._recompute): per layer, its pattern patches (query
        # positions, head, that head's source weights [positions, keys]); the knockout (layers, query
        # positions, key positions); and the keys and values read so far at those layers, kept across
        # the steps chunked prefill splits a prompt into
        self.pattern_patches = {}
        for site, layer, source, positions, head, _, _ in w.patches:
            if site == "pattern":
                pos = list(range(n_prompt)) if positions is None else list(positions)
                weights = sources.patterns[(source, site_key(site, layer))][pos].view(len(pos), -1, n_prompt)[:, head]
                self.pattern_patches.setdefault(layer, []).append((pos, head, weights))
        self.knockout = None if w.knockout is None else (set(w.knockout[0]), list(w.knockout[1]), list(w.knockout[2]))
        self.held_kv = {}
        self.noise = [self._noise(positions, std, seed, widths, dtype) for positions, std, seed in w.noise]
        # a pattern: per query position, every head's weights over this forward's positions
        self.captures = {key: torch.empty(n_tokens, widths["head"] // widths["unit_width"]["head"] * n_tokens
                                          if parse_key(key)[0] == "pattern" else widths[parse_key(key)[0]], dtype=dtype)
                         for key in w.capture} if w.capture else {}
        self.circuit = w.circuit  # [source, kept edge indices] (a circuit run), or None
        self.ablated = None  # its edges outside the circuit, once the circuit hooks have made the mask
        # a circuit's source row of each position of this forward (its tree's rows)
        self.tree = None if w.circuit is None else tree(n_tokens, n_prompt, branch)

    @staticmethod
    def _noise(positions, std, seed, widths, dtype) -> tuple:
        pos = np.asarray(positions, dtype=np.int64)
        return pos, gaussian_noise(Noise(tuple(pos), std, seed), widths["d_model"]).to(dtype)

    def recomputes(self, layer: int) -> bool:
        """Whether some head's output at `layer` is recomputed for this forward."""
        return layer in self.pattern_patches or (self.knockout is not None and layer in self.knockout[0])

    def part(self) -> dict | None:
        """What this forward gives its request beyond the call's arrays (results.CallResults), as plain
        data: its captures, top_k and log-probabilities; None where it has none."""
        if not self.captures and not self.extra:
            return None
        return {**self.extra, "captures": {key: encode_tensor(v) for key, v in self.captures.items()}}
