"""The call's plans as the vLLM worker reads them (vllm_worker/columns.py): every plan's numbers as
arrays by plan, its patches, scored tokens and start rows as flat tables, and a Request only for the
plans that hold more; without vLLM. The engine's numbers against hf's are held by
tests/engine/backends/test_engines_match_hf.py and test_start_midstack.py."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from patchgrid.backends.vllm_worker.columns import Columns, entries
from patchgrid.backends.vllm_worker.held import Sources
from patchgrid.backends.vllm_worker.results import CallResults
from patchgrid.backends.vllm_worker.session import site_widths
from patchgrid.plan import Noise, Patch, Request, Start, encode_tensor, forwards, to_columns

SHAPE = {"vocab_size": 50, "d_model": 8, "n_heads": 2, "head_dim": 4, "d_mlp": 16, "n_kv_heads": 2}


def test_entries_lays_items_out_one_after_another():
    entry, owner = entries(np.array([5, 0, 9]), np.array([2, 0, 3]))
    assert entry.tolist() == [5, 6, 9, 10, 11] and owner.tolist() == [0, 0, 2, 2, 2]
    entry, owner = entries(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert entry.tolist() == [] and owner.tolist() == []


def _columns(requests, tp=(0, 1), patterns=False):
    wire = {"clean": {"resid.1": encode_tensor(torch.randn(6, 8)), "head.0": encode_tensor(torch.randn(6, 8))},
            "corrupt": {"resid.1": encode_tensor(torch.randn(6, 8))}}
    if patterns:  # the pattern of a 3-token prompt: [queries, heads x keys]
        wire["clean"]["pattern.0"] = encode_tensor(torch.rand(3, 2 * 3))
    plans = to_columns(requests, [forwards(r) for r in requests])
    sources = Sources(_across_processes(wire), torch.float32)
    cols = Columns(_across_processes(plans), sources, {"clean": object()}, site_widths(SHAPE, tp[1]), torch.float32,
                   tp)
    results = CallResults(cols.answer_ids)
    results.hand_out(cols.score_start, len(cols.score_token))
    return cols, sources, results


def _across_processes(wired: dict) -> dict:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(wired))


def test_a_grid_plan_is_columns_only_and_a_plan_that_holds_more_is_a_request_too():
    grid = Request(tokens=(1, 2, 3, 4), answers=(7, 8), continuations=((7,), (8,)), reference="clean",
                   patches=(Patch("resid", 1, "clean", (1, 3)), Patch("head", 0, "clean", (2,), 1)),
                   start=Start(2, "corrupt"))
    noised = Request(tokens=(1, 2, 3), answers=(9,), ranks=False, noise=(Noise((0,), 0.5, 1),))
    whole = Request(tokens=(1, 2), answers=(7, 9), continuations=((7, 1, 2), (9, 6)))  # two forwards
    cols, sources, results = _columns([grid, noised, whole])
    assert sorted(cols.special) == [1] and cols.is_special.tolist() == [False, True, False, False]
    assert cols.n_prompt.tolist() == [4, 3, 2, 2] and cols.n_tokens.tolist() == [4, 3, 4, 3]
    assert cols.first.tolist() == [True, True, True, False] and cols.start_layer.tolist() == [2, -1, -1, -1]
    assert cols.reads_vocabulary.tolist() == [True, False, True, True]
    assert cols.reference.tolist() == [0, -1, -1, -1] and cols.n_answers.tolist() == [2, 1, 2, 2]
    # the grid's patches: resid.1 at positions 1 and 3 from clean's rows 1 and 3, head 1 of head.0 at 2
    a, n = cols.patch_start[0], cols.patch_count[0]
    assert n == 3 and cols.patch_pos[a:a + n].tolist() == [1, 3, 2]
    first = sources.first
    assert cols.patch_src[a:a + n].tolist() == [first[("clean", "resid.1")] + 1, first[("clean", "resid.1")] + 3,
                                                first[("clean", "head.0")] + 2]
    assert [cols.groups[g] for g in cols.patch_group[a:a + n]] == [("resid.1", False), ("resid.1", False),
                                                                   ("head.0", True)]
    assert cols.patch_unit[a + 2] == cols.patch_model_unit[a + 2] == 1
    assert cols.patch_count[1:].tolist() == [0, 0, 0]
    # scored tokens: the grid's two one-token answers; the whole answers' forwards, one continuation each
    assert cols.score_count.tolist() == [2, 0, 3, 2] and cols.score_token.tolist() == [7, 8, 7, 1, 2, 9, 6]
    assert cols.score_index.tolist() == [0, 0, 0, 1, 2, 0, 1]
    assert results.score_start.tolist() == cols.score_start.tolist() == [0, 2, 2, 5] and results.slots == 7
    # the start stream's rows: corrupt's resid.1 (the stream entering layer 2), one per position
    s = cols.start_start[0]
    assert cols.start_src[s:s + 4].tolist() == [first[("corrupt", "resid.1")] + p for p in range(4)]


@pytest.mark.parametrize("rank", [0, 1])
def test_under_tensor_parallelism_a_head_is_patched_on_the_rank_that_holds_it(rank):
    req = Request(tokens=(1, 2, 3), answers=(7,), patches=(Patch("head", 0, "clean", (1,), 1),
                                                           Patch("resid", 1, "clean", (0,))))
    cols, _, _ = _columns([req], tp=(rank, 2))
    held = [cols.groups[g] for g in cols.patch_group]
    if rank == 1:  # head 1 of 2 is the second rank's, its head 0 there
        assert held == [("head.0", True), ("resid.1", False)] and cols.patch_unit[0] == 0
        assert cols.patch_model_unit[0] == 1
    else:
        assert held == [("resid.1", False)]


def test_a_whole_patch_reads_each_forwards_tree_rows_and_a_pattern_patch_travels_whole():
    """A whole patch (every row of the request) writes each forward's positions from its rows of the
    tree: the prompt's, then its own continuation's inputs from its branch on; a pattern patch is not
    a column (the attention hook recomputes the head) and its plan travels whole, a Request."""
    whole = Request(tokens=(1, 2), answers=(7, 9), continuations=((7, 1, 2), (9, 6)),
                    patches=(Patch("resid", 1, "clean", whole=True),))
    pattern = Request(tokens=(1, 2, 3), answers=(7, 8), patches=(Patch("pattern", 0, "clean", (2,), 1),
                                                                 Patch("resid", 1, "corrupt", (0,))))
    cols, sources, _ = _columns([whole, pattern], patterns=True)
    row = sources.first[("clean", "resid.1")]
    spans = [(int(a), int(a + n)) for a, n in zip(cols.patch_start, cols.patch_count)]
    assert [cols.patch_pos[a:b].tolist() for a, b in spans] == [[0, 1, 2, 3], [0, 1, 2], [0]]
    assert cols.patch_src[spans[0][0]:spans[0][1]].tolist() == [row + r for r in (0, 1, 2, 3)]
    assert cols.patch_src[spans[1][0]:spans[1][1]].tolist() == [row + r for r in (0, 1, 4)]  # branch 4
    assert cols.patch_src[spans[2][0]].tolist() == sources.first[("corrupt", "resid.1")]
    assert sorted(cols.special) == [2] and cols.special[2].pattern_patches[0][0][1] == 1


def test_a_patch_whose_source_the_call_lacks_is_named():
    req = Request(tokens=(1, 2, 3), answers=(7,), patches=(Patch("resid", 1, "elsewhere", (0,)),))
    with pytest.raises(RuntimeError, match="patch source 'elsewhere' holds no resid.1"):
        _columns([req])
