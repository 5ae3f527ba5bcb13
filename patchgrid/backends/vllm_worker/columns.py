"""A call's plans as columns: what the step planning and the readout read of every plan, as numpy
arrays indexed by plan (the k of request.request_id), and the plans' patches, scored tokens and
start rows as flat tables, each plan's entries together from `*_start[k]` on. A step then
plans and reads all its requests in a few array operations (step.plan_step, readout.read), not a
loop over them: a grid's patched run costs no Python object of its own in the worker.

What few plans hold beyond these (noise, captures, circuits, pattern patches, knockouts, top_k,
log-probabilities) is a request.Request each, `special[k]`, which the step and the readout visit
one by one.

    n_prompt, n_tokens  [plans]  the prompt's length (patches and noise address its positions), and the
                                 forward's (the prompt and one continuation's inputs)
    first               [plans]  the request's first forward: its last prompt position reads the answers
    start_layer         [plans]  the layer it starts at (plan.Start), -1 from the embedding
    reads_vocabulary    [plans]  its readout needs the vocabulary's logsumexp (plan.Request.reads_vocabulary)
    ranked, n_answers   [plans]  it reads its answers' ranks; how many answers it has
    reference           [plans]  the index of its KL reference in `references`, -1: none
    extra               [plans]  it reads top_k or log-probabilities (special[k] holds where they go)
    is_special          [plans]  special[k] exists
    patch_start, patch_count         [plans]  where a plan's patch entries begin, and how many
    patch_pos, patch_src, patch_group, patch_unit, patch_model_unit   [entries]  a patched position, the
                        stacked source row it takes (request.Sources), its group (`groups`: (site key,
                        patched by unit)), its unit on this rank and in the model
    score_start, score_count         [plans]  where a plan's scored tokens begin, and how many
    score_index, score_token         [entries]  a scored token's index in its continuation (position
                        n_prompt - 1 + index predicts it) and the token; its entry is its results' score slot
    start_start         [plans]  where a plan's start rows begin (n_tokens of them, one per position)
    start_src           [entries]  the stacked source row of the stream entering the start layer
"""
from __future__ import annotations

import numpy as np

from ...plan import patch_rows, stream_key
from ...sites import SITES, site_key
from ...tp import unit_owner
from .request import Request, Sources, tree
from .results import CallResults


class Columns:
    def __init__(self, plans: list, sources: Sources, references: dict, widths: dict, dtype, tp=(0, 1), *,
                 results: CallResults):
        self.first_of, self.widths, self.tp = sources.first, widths, tp
        first_of = sources.first
        self.references = list(references.values())
        ref_index = {name: i for i, name in enumerate(references)}
        self.groups: list[tuple[str, bool]] = []  # a patch group's (site key, patched by unit)
        self._group_of: dict[tuple[str, bool], int] = {}
        self._keys: dict[tuple[str, int], str] = {}
        self.special: dict[int, Request] = {}
        n = len(plans)
        n_prompt, n_tokens, first, start_layer = [0] * n, [0] * n, [False] * n, [-1] * n
        reads_vocabulary, ranked, n_answers, reference, extra = [False] * n, [False] * n, [0] * n, [-1] * n, [False] * n
        patch_start = [0] * n
        patch_columns = patch_pos, patch_src, patch_group, patch_unit, patch_model_unit = [], [], [], [], []
        score_start, score_index, score_token = [0] * n, [], []
        start_start, start_src = [0] * n, []
        for k, plan in enumerate(plans):
            (_, (prompt, scores, branch, is_first, length), answers, top_k, capture, patches, noise, start,
             continuations, ref, logprobs, ranks, circuit, knockout) = plan
            n_prompt[k], n_tokens[k], first[k] = prompt, length, is_first
            reads_vocabulary[k] = bool(continuations or ref is not None or ranks or top_k or logprobs)
            ranked[k], n_answers[k], extra[k] = ranks, len(answers), bool(top_k or logprobs)
            if ref is not None:
                reference[k] = ref_index[ref]
            score_start[k] = len(score_token)
            for j in scores:
                score_index.extend(range(len(continuations[j])))
                score_token.extend(continuations[j])
            patch_start[k] = len(patch_pos)
            pattern = self._patches(patches, prompt, length, branch, patch_columns)
            if start is not None:
                start_layer[k] = start[0]
                row = first_of[(start[1], stream_key(start[0]))]
                start_start[k] = len(start_src)
                start_src.extend(range(row, row + length) if length == prompt
                                 else [row + r for r in tree(length, prompt, branch)])
            if noise or capture or pattern or circuit is not None or knockout is not None or top_k or logprobs:
                self.special[k] = Request(plan, sources, widths, dtype, k=k)
        i64 = np.int64
        self.n_prompt, self.n_tokens = np.array(n_prompt, dtype=i64), np.array(n_tokens, dtype=i64)
        self.first, self.start_layer = np.array(first, dtype=bool), np.array(start_layer, dtype=i64)
        self.reads_vocabulary, self.ranked = np.array(reads_vocabulary, dtype=bool), np.array(ranked, dtype=bool)
        self.n_answers, self.reference = np.array(n_answers, dtype=i64), np.array(reference, dtype=i64)
        self.extra = np.array(extra, dtype=bool)
        self.is_special = np.zeros(n, dtype=bool)
        self.is_special[list(self.special)] = True
        self.patch_start = np.array(patch_start, dtype=i64)
        self.patch_count = np.diff(np.append(self.patch_start, len(patch_pos)))
        self.patch_pos, self.patch_src = np.array(patch_pos, dtype=i64), np.array(patch_src, dtype=i64)
        self.patch_group = np.array(patch_group, dtype=i64)
        self.patch_unit, self.patch_model_unit = np.array(patch_unit, dtype=i64), np.array(patch_model_unit, dtype=i64)
        self.score_start = np.array(score_start, dtype=i64)
        self.score_count = np.diff(np.append(self.score_start, len(score_token)))
        self.score_index, self.score_token = np.array(score_index, dtype=i64), np.array(score_token, dtype=i64)
        self.start_start, self.start_src = np.array(start_start, dtype=i64), np.array(start_src, dtype=i64)
        results.hand_out(self.score_start, len(score_token))

    def _patches(self, patches: list, prompt: int, length: int, branch: int, out: tuple) -> bool:
        """A plan's patches (Patch's fields, as they travel) onto the patch columns `out` (positions,
        source rows, groups, units on this rank, units in the model); a head or neuron only on the rank
        that holds it. Whether it holds a pattern patch (recomputed in the attention hook: the
        request's own, request.Request)."""
        positions_out, src_out, group_out, unit_out, model_unit_out = out
        rank, tp_size = self.tp
        pattern = False
        for site, layer, source, positions, head, neuron, whole in patches:
            if site == "pattern":
                pattern = True
                continue
            key = self._keys.get((site, layer))
            if key is None:
                key = self._keys[site, layer] = site_key(site, layer)
            model_unit = head if head is not None else neuron  # Patch.unit
            unit = model_unit
            if unit is not None and tp_size > 1:
                owner, unit = unit_owner(model_unit, self.widths["units"][SITES[site].unit], tp_size)
                if owner != rank:  # another rank holds this head's slice of z, or this neuron
                    continue
            group = self._group_of.get((key, unit is not None))
            if group is None:
                group = self._group_of[key, unit is not None] = len(self.groups)
                self.groups.append((key, unit is not None))
            row = self.first_of[(source, key)]
            if whole or positions is None:
                positions, rows = patch_rows(positions, whole, prompt, length, branch)
                src_out.extend([row + r for r in rows])
            else:
                src_out.extend([row + p for p in positions])
            positions_out.extend(positions)
            m = len(positions)
            group_out.extend([group] * m)
            unit_out.extend([unit or 0] * m)
            model_unit_out.extend([model_unit or 0] * m)
        return pattern


def entries(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The flat entries of items whose entries are `counts[i]` long from `starts[i]` on, one item
    after another; and the item each entry belongs to."""
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts)), counts)
    before = np.cumsum(counts) - counts  # each item's first entry among the flat ones
    return np.arange(total, dtype=np.int64) + (starts - before)[owner], owner
