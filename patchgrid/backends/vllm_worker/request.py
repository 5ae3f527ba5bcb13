"""One vLLM request as the worker sees it: its plan, read from its SamplingParams, and what it
gathers across scheduler steps; and the call's sources, stacked per site key.

A patchgrid request whose answers are scored whole is several vLLM requests, one per forward
(plan.forwards): the prompt followed by one continuation's inputs. Patches and noise address the
prompt's positions only. A call's plans travel as plain data (`plan.to_wire`) with its sources,
once per call (`pg_begin`); each vLLM request's id names its plan (`request_id`), so that every
forward shares one SamplingParams. The values the plans patch in are the call's sources, held in
the worker and named by the plan. A Request holds no patch value: it names the rows of the stacked sources
(`Sources`) each patch reads, and the step gathers every value of a site key in one index
(step.plan_step).
"""
from __future__ import annotations

import numpy as np
import torch

from ...plan import (
    LOGPROBS,
    Forward,
    Noise,
    WirePlan,
    decode_tensor,
    encode_tensor,
    gaussian_noise,
    patch_rows,
    stream_key,
    tree_rows,
)
from ...sites import SITES, parse_key, site_key
from ...tp import unit_owner
from .results import CallResults


def request_id(call: int, k: int) -> str:
    """The vLLM request id of forward `k` of engine call `call` (the k-th of its plans)."""
    return f"pg{call}.{k}"


def plan_index(rid: str, call: int) -> int | None:
    """Which of call `call`'s plans the vLLM request `rid` runs (vLLM appends `-<random>` to the id
    it was given); None: a request of no patchgrid call, or of another."""
    given = rid.partition("-")[0]
    prefix = f"pg{call}."
    if not given.startswith(prefix) or not given[len(prefix):].isdigit():
        return None
    return int(given[len(prefix):])


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


def _tree(n_tokens: int, n_prompt: int, branch: int) -> list[int]:
    """The tree rows of a forward's positions (plan.tree_rows): its prompt's, then from `branch` on."""
    if n_tokens == n_prompt:
        return list(range(n_prompt))
    return tree_rows(Forward((0,) * n_tokens, (), branch, True), n_prompt)


class Request:
    """One vLLM request (a forward of a patchgrid request, plan.forwards): its plan and what it has
    gathered so far, kept across scheduler steps."""

    __slots__ = ("k", "tag", "first", "answers", "top_k", "n_prompt", "n_tokens", "logprobs", "ranks", "reference",
                 "reads_vocabulary", "scores", "one_row", "extra", "patches", "pattern_patches", "knockout",
                 "held_kv", "noise", "captures", "start_layer", "circuit", "ablated", "tree", "start_rows")

    def __init__(self, plan: list, sources: Sources, references, widths, dtype, tp=(0, 1), *,
                 k: int, results: CallResults):
        """Plan `k` of the call (request_id), whose numbers the readout writes into `results` (by k)."""
        # read from the plan as it travels (plan.WirePlan), without building its plan.Request or an
        # object per patch: a grid's run is one of these per run
        w = WirePlan(*plan)
        n_prompt, scores, branch, self.first, n_tokens = w.forward
        self.k = k
        self.tag = w.tag
        self.answers = w.answers
        self.top_k = w.top_k
        self.n_prompt = n_prompt  # patches and noise address the prompt's positions
        self.n_tokens = n_tokens  # the prompt and one continuation's inputs
        self.logprobs = w.logprobs
        self.ranks = w.ranks
        self.reference = None if w.reference is None else references[w.reference]
        self.reads_vocabulary = w.reads_vocabulary  # False: its answers' logits are all it reads
        # every token it scores, flat, in its continuations' order (theirs in the plan's): (its index in its
        # continuation, the token, the results' score slot it is written to), as three lists; position
        # n_prompt - 1 + i predicts the token of index i. `one_row`: every one is predicted at the last
        # prompt position (a grid's answers of one token)
        self.scores = ([], [], [])
        if scores:
            conts = w.continuations
            tokens = [t for j in scores for t in conts[j]]
            slot = results.take(k, len(tokens))
            self.scores = ([i for j in scores for i in range(len(conts[j]))], tokens,
                           list(range(slot, slot + len(tokens))))
        self.one_row = not any(self.scores[0])
        self.extra = {}  # top_k's ids and logits, the log-probabilities (readout.read)
        # heads' outputs recomputed (hooks.SiteHooks._recompute): per layer, its pattern patches (query
        # positions, head, that head's source weights [positions, keys]); the knockout (layers, query
        # positions, key positions); and the keys and values read so far at those layers, kept across
        # the steps chunked prefill splits a prompt into
        self.pattern_patches = {}
        self.patches = self._patches(w.patches, branch, sources, widths, tp) if w.patches else {}
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
        self.tree = None if w.circuit is None else _tree(n_tokens, n_prompt, branch)
        # the layer it starts at (plan.Start; None: the embedding), and the stacked sources' rows of the
        # stream entering it, one per position of this forward (the stream source holds the request's tree
        # of rows: this forward's are its own)
        self.start_layer = self.start_rows = None
        if w.start is not None:
            self.start_layer, source = w.start
            first = sources.first[(source, stream_key(self.start_layer))]
            self.start_rows = [first + row for row in _tree(n_tokens, n_prompt, branch)]

    @staticmethod
    def _noise(positions, std, seed, widths, dtype) -> tuple:
        pos = np.asarray(positions, dtype=np.int64)
        return pos, gaussian_noise(Noise(tuple(pos), std, seed), widths["d_model"]).to(dtype)

    def _patches(self, patches: list, branch: int, sources: Sources, widths, tp) -> dict:
        """{(site key, patched by unit): (positions, stacked source rows, units on this rank, units in
        the model)} as lists, from the plan's patches (Patch's fields, in order); a head or neuron only on
        the rank that holds it; a pattern patch into `pattern_patches`."""
        rank, tp_size = tp
        n_prompt = self.n_prompt
        first_of = sources.first
        out: dict[tuple[str, bool], tuple[list, list, list, list]] = {}
        for site, layer, source, positions, head, neuron, whole in patches:
            key = site_key(site, layer)
            if site == "pattern":  # recomputed in the attention hook
                pos = list(range(n_prompt)) if positions is None else list(positions)
                weights = sources.patterns[(source, key)][pos].view(len(pos), -1, n_prompt)[:, head]
                self.pattern_patches.setdefault(layer, []).append((pos, head, weights))
                continue
            unit = model_unit = head if head is not None else neuron  # Patch.unit
            if unit is not None and tp_size > 1:
                owner, unit = unit_owner(model_unit, widths["units"][SITES[site].unit], tp_size)
                if owner != rank:  # another rank holds this head's slice of z, or this neuron
                    continue
            first = first_of[(source, key)]
            pos, rows = patch_rows(positions, whole, n_prompt, self.n_tokens, branch)
            rows = [first + row for row in rows]
            entry = out.get((key, unit is not None))
            if entry is None:
                out[key, unit is not None] = entry = ([], [], [], [])
            entry[0].extend(pos)
            entry[1].extend(rows)
            if unit is not None:
                entry[2].extend([unit] * len(pos))
                entry[3].extend([model_unit] * len(pos))
        return out

    def recomputes(self, layer: int) -> bool:
        """Whether some head's output at `layer` is recomputed for this forward."""
        return layer in self.pattern_patches or (self.knockout is not None and layer in self.knockout[0])

    def part(self) -> dict | None:
        """What this forward gives its request beyond the call's arrays (results.CallResults), as plain
        data: its captures, top_k and log-probabilities; None where it has none."""
        if not self.captures and not self.extra:
            return None
        return {**self.extra, "captures": {key: encode_tensor(v) for key, v in self.captures.items()}}
