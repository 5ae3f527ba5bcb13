"""A call's plans as columns: what the step planning and the readout read of every plan, as numpy
arrays indexed by plan (the k of request.request_id), and the plans' patches, scored tokens and
start rows as flat tables, each plan's entries together from `*_start[k]` on. A step then
plans and reads all its requests in a few array operations (step.plan_step, readout.read), not a
loop over them: a grid's patched run costs no Python object of its own in the worker. The host
sends them as columns (plan.to_columns); here they are completed with what only the worker knows:
each patch's and start's rows in the stacked sources (request.Sources), which tensor-parallel rank
holds a head or neuron, and the KL references' order.

What few plans hold beyond these (noise, captures, circuits, pattern patches, knockouts, top_k,
log-probabilities) is a held.HeldRequest each, `special[k]`, which the step and the readout visit
one by one.

    n_prompt, n_tokens  [plans]  the prompt's length (patches and noise address its positions), and the
                                 forward's (the prompt and one continuation's inputs)
    first               [plans]  the request's first forward: its last prompt position reads the answers
    start_layer         [plans]  the layer it starts at (plan.Start), -1 from the embedding
    reads_vocabulary    [plans]  its readout needs the vocabulary's logsumexp (plan.Request.reads_vocabulary)
    ranked, n_answers   [plans]  it reads its answers' ranks; how many answers it has
    answer_ids          [plans, most answers]  its answer ids (0 past its own)
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

from ...model.sites import SITES, parse_key
from ...model.tp import units_per_rank
from ...plan import decode_array
from .held import HeldRequest, Sources


class Columns:
    def __init__(self, wired: dict, sources: Sources, references: dict, widths: dict, dtype, tp=(0, 1)):
        """`wired`: plan.to_columns' columns; `references` the call's KL references by source name."""
        a = {name: decode_array(enc) for name, enc in wired["arrays"].items()}
        names, keys = wired["names"], wired["keys"]
        n = len(a["n_prompt"])
        self.n_prompt, self.n_tokens, self.start_layer = a["n_prompt"], a["n_tokens"], a["start_layer"]
        self.first, self.ranked = a["first"].astype(bool), a["ranked"].astype(bool)
        self.reads_vocabulary, self.extra = a["reads_vocabulary"].astype(bool), a["extra"].astype(bool)
        self.n_answers, self.answer_ids = a["n_answers"], a["answers"]
        branch = a["branch"]
        self.references = list(references.values())
        ref_of = np.array([list(references).index(name) if name in references else -1 for name in names] + [-1],
                          dtype=np.int64)  # by source number; -1 (no reference) reads the last
        self.reference = ref_of[a["reference"]]
        if (self.reference[a["reference"] >= 0] < 0).any():
            missing = names[int(a["reference"][(a["reference"] >= 0) & (self.reference < 0)][0])]
            raise RuntimeError(f"patchgrid worker: KL reference {missing!r} holds no log-probabilities in this call")
        first_row = _first_rows(sources, names, keys)
        self.special = {int(k): HeldRequest(plan, sources, widths, dtype, k=int(k)) for k, plan in wired["special"]}
        self.is_special = np.zeros(n, dtype=bool)
        self.is_special[list(self.special)] = True

        # patches: each entry a position of a patch, its plan's entries together
        patch = np.repeat(np.arange(len(a["patch_npos"])), a["patch_npos"])
        owner = np.repeat(np.repeat(np.arange(n), a["patch_count"]), a["patch_npos"])
        pos, name, key, unit = a["patch_pos"], a["patch_name"][patch], a["patch_key"][patch], a["patch_unit"][patch]
        src = _rows_of(first_row, name, key, names, keys, "patch") + _tree_rows(pos, self.n_prompt[owner],
                                                                                  branch[owner])
        by_unit = unit >= 0
        local = unit
        rank, tp_size = tp
        if tp_size > 1 and by_unit.any():  # a head or neuron only on the rank that holds it
            per_key = np.ones(len(keys), dtype=np.int64)
            for j in np.unique(key[by_unit]).tolist():
                per_key[j] = _per_rank(keys[j], widths, tp_size)
            per = per_key[key]
            kept = ~by_unit | (unit // per == rank)
            local = np.where(by_unit, unit % per, unit)
            pos, src, key, unit, local, by_unit, owner = (x[kept] for x in (pos, src, key, unit, local, by_unit, owner))
        group, inverse = np.unique(key * 2 + by_unit, return_inverse=True)  # (site key, patched by unit)
        self.patch_group = inverse.reshape(-1).astype(np.int64)
        self.groups: list[tuple[str, bool]] = [(keys[g // 2], bool(g % 2)) for g in group.tolist()]
        self.patch_pos, self.patch_src = pos, src
        self.patch_unit, self.patch_model_unit = np.where(by_unit, local, 0), np.where(by_unit, unit, 0)
        self.patch_count = np.bincount(owner, minlength=n).astype(np.int64)
        self.patch_start = np.cumsum(self.patch_count) - self.patch_count

        self.score_count = a["score_count"]
        self.score_start = np.cumsum(self.score_count) - self.score_count
        self.score_index, self.score_token = a["score_index"], a["score_token"]

        # start rows: every position of a plan that starts mid-stack reads the stream entering its layer
        count = np.where(self.start_layer >= 0, self.n_tokens, 0)
        self.start_start = np.cumsum(count) - count
        entry, owner = entries(self.start_start, count)
        at = entry - self.start_start[owner]
        self.start_src = (_rows_of(first_row, a["start_name"][owner], a["start_key"][owner], names, keys, "start")
                          + _tree_rows(at, self.n_prompt[owner], branch[owner]))


def _first_rows(sources: Sources, names: list, keys: list) -> np.ndarray:
    """[sources, keys]: the stacked row each source's rows of each key start at (-1: it holds none)."""
    name_of, key_of = {name: i for i, name in enumerate(names)}, {key: j for j, key in enumerate(keys)}
    table = np.full((len(names), len(keys)), -1, dtype=np.int64)
    for (name, key), row in sources.first.items():
        if name in name_of and key in key_of:
            table[name_of[name], key_of[key]] = row
    return table


def _rows_of(table: np.ndarray, name: np.ndarray, key: np.ndarray, names: list, keys: list, what: str) -> np.ndarray:
    base = table[name, key]
    if (base < 0).any():
        i = int(np.flatnonzero(base < 0)[0])
        raise RuntimeError(f"patchgrid worker: {what} source {names[int(name[i])]!r} holds no {keys[int(key[i])]} "
                           "in this call's sources")
    return base


def _tree_rows(pos: np.ndarray, n_prompt: np.ndarray, branch: np.ndarray) -> np.ndarray:
    """A forward's positions' rows in its request's tree (plan.tree_rows): the prompt's, then from its branch on."""
    return np.where(pos < n_prompt, pos, branch + pos - n_prompt)


def _per_rank(key: str, widths: dict, tp_size: int) -> int:
    """How many of a key's units (heads, key/value heads or neurons) each tensor-parallel rank holds."""
    unit = SITES[parse_key(key)[0]].unit
    return units_per_rank(widths["units"][unit], tp_size, f"{unit}s")


def entries(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The flat entries of items whose entries are `counts[i]` long from `starts[i]` on, one item
    after another; and the item each entry belongs to."""
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts)), counts)
    before = np.cumsum(counts) - counts  # each item's first entry among the flat ones
    return np.arange(total, dtype=np.int64) + (starts - before)[owner], owner
