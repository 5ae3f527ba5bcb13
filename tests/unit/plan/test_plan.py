"""Plans out of range are refused before anything runs, naming the field."""
from __future__ import annotations

import pytest
import torch

from patchgrid.model.sites import LLAMA, ModelShape
from patchgrid.plan import (
    Knockout,
    Noise,
    Patch,
    PlanError,
    Request,
    Start,
    decode_tensor,
    encode_tensor,
    from_wire,
    latest_start,
    recomputed_heads,
    to_wire,
    validate,
)

SHAPE = ModelShape(LLAMA, n_layers=4, n_heads=4, head_dim=32, d_model=128, vocab_size=500, max_len=64, d_mlp=256)
TOKENS = (1, 2, 3, 4, 5)
SOURCES = {"clean": {"resid.1": torch.zeros(5, 128), "head.2": torch.zeros(5, 128), "embed": torch.zeros(5, 128),
                     "neuron.1": torch.zeros(5, 256)}}


def refused(req, match, sources=SOURCES):
    with pytest.raises(PlanError, match=match):
        validate([req], sources, SHAPE)


def test_valid_plan_passes():
    validate([Request(tokens=TOKENS, answers=(1, 2), capture=("resid.3", "embed", "head.0"),
                      patches=(Patch("resid", 1, "clean", (0, 4)), Patch("head", 2, "clean", None, 3),
                               Patch("embed", None, "clean", (1,))),
                      noise=(Noise((1, 2), 1.0, 0),))], SOURCES, SHAPE)


@pytest.mark.parametrize("req, match", [
    (Request(tokens=TOKENS, patches=(Patch("resid", 4, "clean", (0,)),)), "layer 4 is out of range"),
    (Request(tokens=TOKENS, patches=(Patch("resid", -1, "clean", (0,)),)), "layer -1 is out of range"),
    (Request(tokens=TOKENS, patches=(Patch("resid", 1, "clean", (5,)),)), "position 5 is out of range"),
    (Request(tokens=TOKENS, patches=(Patch("head", 2, "clean", (0,), 4),)), "head 4 is out of range"),
    (Request(tokens=TOKENS, patches=(Patch("head", 2, "clean", (0,), None),)), "head None is out of range"),
    (Request(tokens=TOKENS, patches=(Patch("resid", 1, "clean", (0,), 1),)), "head is set for site resid"),
    (Request(tokens=TOKENS, patches=(Patch("neuron", 1, "clean", (0,), neuron=256),)), "neuron 256 is out of range"),
    (Request(tokens=TOKENS, patches=(Patch("neuron", 1, "clean", (0,), 3),)), "head is set for site neuron"),
    (Request(tokens=TOKENS, patches=(Patch("head", 2, "clean", (0,), 1, 3),)), "neuron is set for site head"),
    (Request(tokens=TOKENS, patches=(Patch("mlp", 1, "clean", (0,)),)), "site 'mlp' is unknown"),
    (Request(tokens=TOKENS, patches=(Patch("resid", 1, "other", (0,)),)), "source 'other' is not among"),
    (Request(tokens=TOKENS, patches=(Patch("resid", 2, "clean", (0,)),)), "holds no resid.2"),
    (Request(tokens=TOKENS, capture=("resid.9",)), "capture layer 9 is out of range"),
    (Request(tokens=TOKENS, capture=("z.1",)), "bad site key 'z.1'"),
    (Request(tokens=TOKENS, noise=(Noise((7,), 1.0, 0),)), "noise.positions position 7"),
    (Request(tokens=TOKENS, noise=(Noise((1,), -1.0, 0),)), "noise.std"),
    (Request(tokens=TOKENS, answers=(500,)), "answer id 500 is outside the vocabulary"),
    (Request(tokens=(1, 999)), "token id 999 is outside"),
    (Request(tokens=()), "tokens is empty"),
    (Request(tokens=tuple(range(65))), "more than the model's 64"),
    (Request(tokens=TOKENS, top_k=-1), "top_k -1 is negative"),
])
def test_out_of_range_is_refused(req, match):
    refused(req, match)


def test_source_shorter_than_patch_positions():
    short = {"clean": {"resid.1": torch.zeros(3, 128)}}
    refused(Request(tokens=TOKENS, patches=(Patch("resid", 1, "clean", (4,)),)), "has 3 positions", short)


def test_a_request_sharing_what_an_earlier_one_passed_is_still_checked_for_its_own_fields():
    """validate checks a call's shared tokens, units and sources once: what differs is still refused,
    naming the request that has it."""
    good = Request(tokens=TOKENS, answers=(1, 2), patches=(Patch("resid", 1, "clean", (0,)),))
    cases = [
        (Request(tokens=TOKENS, answers=(1, 2), patches=(Patch("resid", 1, "clean", (5,)),)),
         "request 2: patch.positions position 5 is out of range"),
        (Request(tokens=TOKENS + (6, 7), answers=(1, 2), patches=(Patch("resid", 1, "clean", (6,)),)),
         "request 2: patch source 'clean' resid.1 has 5 positions, the patch needs 7"),
        (Request(tokens=TOKENS, answers=(1, 999), patches=(Patch("resid", 1, "clean", (0,)),)),
         "request 2: answer id 999 is outside the vocabulary"),
        (Request(tokens=TOKENS, answers=(1, 2), patches=(Patch("head", 1, "clean", (0,), 9),)),
         "request 2: patch head 9 is out of range"),
    ]
    for bad, match in cases:
        with pytest.raises(PlanError, match=match):
            validate([good, good, bad], SOURCES, SHAPE)
    # a request built by hand with lists is checked as a tuple's is
    listed = Request(tokens=list(TOKENS), answers=[1, 2], patches=(Patch("resid", 1, "clean", [0]),),
                     continuations=[[1], [2]])
    validate([listed, listed], SOURCES, SHAPE)
    with pytest.raises(PlanError, match="request 1: answer id 999 is outside the vocabulary"):
        validate([listed, Request(tokens=list(TOKENS), answers=[1, 999])], SOURCES, SHAPE)


def test_tensor_codec_round_trips_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(3, 5).to(dtype)
        assert torch.equal(decode_tensor(encode_tensor(t)), t)


STREAMS = {"corrupt": {"resid.1": torch.zeros(5, 128), "resid.2": torch.zeros(5, 128)}, **SOURCES}


def test_start_allows_patches_on_its_stream_and_above():
    validate([Request(tokens=TOKENS, start=Start(2, "corrupt"), capture=("resid.1", "attn_out.2"),
                      patches=(Patch("resid", 1, "clean", (0,)), Patch("head", 2, "clean", None, 3)))],
             {**STREAMS, "clean": {**SOURCES["clean"], "resid.1": torch.zeros(5, 128)}}, SHAPE)


@pytest.mark.parametrize("req, match", [
    (Request(tokens=TOKENS, start=Start(0, "corrupt")), "start layer 0 is out of range"),
    (Request(tokens=TOKENS, start=Start(4, "corrupt")), "start layer 4 is out of range"),
    (Request(tokens=TOKENS, start=Start(2, "other")), "start source 'other' is not among"),
    (Request(tokens=TOKENS, start=Start(3, "corrupt")), "holds no resid.2, the stream entering layer 3"),
    (Request(tokens=TOKENS, start=Start(2, "corrupt"), patches=(Patch("embed", None, "clean", (1,)),)),
     "patch embed lies below start layer 2"),
    (Request(tokens=TOKENS, start=Start(3, "corrupt"), patches=(Patch("head", 2, "clean", (1,), 0),)),
     "patch head.2 lies below start layer 3"),
    (Request(tokens=TOKENS, start=Start(2, "corrupt"), capture=("resid.0",)), "capture resid.0 lies below"),
])
def test_bad_start_is_refused(req, match):
    sources = {**STREAMS, "corrupt": {**STREAMS["corrupt"], "resid.2": torch.zeros(5, 128)}}
    if "resid.2" in match:
        sources = STREAMS | {"corrupt": {"resid.1": torch.zeros(5, 128)}}
    refused(req, match, sources)


def test_latest_start_is_the_lowest_patched_layer():
    p = lambda site, layer: Patch(site, layer, "clean", (0,), 0 if site == "head" else None)  # noqa: E731
    assert latest_start([p("resid", 1)], 4) == 2  # the stream entering layer 2 holds the patch
    assert latest_start([p("resid", 3)], 4) == 3  # the last layer always runs
    assert latest_start([p("attn_out", 2), p("mlp_out", 3)], 4) == 2
    assert latest_start([p("head", 0)], 4) == 0
    assert latest_start([p("embed", None)], 4) == 0
    assert latest_start([], 4) == 3  # an unpatched run: only the last layer on the cached stream


def test_start_crosses_the_wire():
    from patchgrid.plan import from_wire, to_wire

    req = Request(tokens=(), answers=(1,), start=Start(2, "0:corrupt"))
    assert from_wire(to_wire(req, "t"))[1].start == Start(2, "0:corrupt")


def test_new_sites_validate_by_their_own_units():
    shape = ModelShape(LLAMA, n_layers=4, n_heads=4, head_dim=32, d_model=128, vocab_size=500, max_len=64, d_mlp=256,
                       n_kv_heads=2)
    sources = {"clean": {"q.1": torch.zeros(5, 128), "k.1": torch.zeros(5, 64), "resid_pre.0": torch.zeros(5, 128),
                         "resid_mid.3": torch.zeros(5, 128), "pattern.1": torch.zeros(5, 20)}}
    validate([Request(tokens=TOKENS, patches=(Patch("q", 1, "clean", (0,), 3), Patch("k", 1, "clean", None, 1),
                                              Patch("resid_pre", 0, "clean", (2,)), Patch("resid_mid", 3, "clean")),
                      capture=("pattern.2", "v.0"))], sources, shape)
    for patch, match in [(Patch("k", 1, "clean", (0,), 2), "head 2 is out of range \\(model has 2 key/value heads"),
                         (Patch("q", 1, "clean", (0,)), "head None is out of range"),
                         (Patch("pattern", 1, "clean", (0,), 4), "head 4 is out of range"),
                         (Patch("k", 1, "clean", None, 0, whole=True), "whole .* takes no positions and no unit"),
                         (Patch("resid_pre", 0, "clean", (1,), whole=True), "whole .* takes no positions")]:
        with pytest.raises(PlanError, match=match):
            validate([Request(tokens=TOKENS, patches=(patch,))], sources, shape)
    # a pattern patch reads the pattern of a prompt as long as its own: 4 heads x 5 keys
    validate([Request(tokens=TOKENS, patches=(Patch("pattern", 1, "clean", (0, 4), 3),))], sources, shape)
    with pytest.raises(PlanError, match="pattern.1 has shape \\(5, 16\\), expected \\[5, 20\\]"):
        validate([Request(tokens=TOKENS, patches=(Patch("pattern", 1, "narrow", (0,), 0),))],
                 {"narrow": {"pattern.1": torch.zeros(5, 16)}}, shape)
    # k of a model with 2 key/value heads is 64 wide, not 128
    with pytest.raises(PlanError, match="k.1 has shape \\(5, 128\\), expected \\[tokens, 64\\]"):
        validate([Request(tokens=TOKENS, patches=(Patch("k", 1, "wide", (0,), 0),))],
                 {"wide": {"k.1": torch.zeros(5, 128)}}, shape)


def test_a_whole_patch_needs_the_request_tree_and_crosses_the_wire():
    from patchgrid.plan import from_wire, patch_rows, to_wire

    whole = Patch("attn_out", 1, "src", whole=True)
    req = Request(tokens=TOKENS, continuations=((7, 8, 9), (4,)), patches=(whole,))  # tree: 5 + 2 rows
    with pytest.raises(PlanError, match="has 5 positions, the patch needs 7"):
        validate([req], {"src": {"attn_out.1": torch.zeros(5, 128)}}, SHAPE)
    validate([req], {"src": {"attn_out.1": torch.zeros(7, 128)}}, SHAPE)
    assert from_wire(to_wire(req, "t"))[1].patches == (whole,)
    # the continuation's forward (prompt + 7, 8): positions 0-6 from tree rows 0-4, then 5, 6
    assert patch_rows(whole.positions, whole.whole, 5, 7, 5) == (list(range(7)), list(range(7)))
    assert patch_rows((2, 4), False, 5, 7, 5) == ([2, 4], [2, 4])
    # with a second answer of several tokens, its forward's inputs past the prompt are stored after the first's
    assert patch_rows(whole.positions, whole.whole, 5, 7, 7) == (list(range(7)), [0, 1, 2, 3, 4, 7, 8])


def test_a_layers_neurons_may_be_patched_whole_and_its_heads_may_not():
    """Every neuron of a layer at once (neuron unset): path patching's way into an MLP's input."""
    whole = Request(tokens=TOKENS, patches=(Patch("neuron", 1, "clean", (0,)),))
    validate([whole], {"clean": {"neuron.1": torch.zeros(len(TOKENS), SHAPE.d_mlp)}}, SHAPE)
    with pytest.raises(PlanError, match="head None is out of range"):
        validate([Request(tokens=TOKENS, patches=(Patch("head", 2, "clean", (0,)),))], SOURCES, SHAPE)


def test_a_knockout_travels_and_is_checked():
    shape = ModelShape(LLAMA, n_layers=4, n_heads=4, head_dim=32, d_model=128, vocab_size=500, max_len=64)
    req = Request(tokens=TOKENS, knockout=Knockout((1, 2), (4,), (1, 2)))
    assert from_wire(to_wire(req, "t"))[1].knockout == req.knockout
    assert recomputed_heads(req) == {"pattern.1", "head.1", "pattern.2", "head.2"}
    assert latest_start((), 4, req.knockout) == 1
    validate([req], {}, shape)
    for knockout, match in [(Knockout((4,), (4,), (1,)), "knockout layer 4 is out of range"),
                            (Knockout((0,), (5,), (1,)), "knockout.queries position 5 is out of range"),
                            (Knockout((0,), (1,), (0, 1)), "blocks every key query position 1 reads"),
                            (Knockout((), (1,), (0,)), "at least one layer")]:
        with pytest.raises(PlanError, match=match):
            validate([Request(tokens=TOKENS, knockout=knockout)], {}, shape)
    with pytest.raises(PlanError, match="knockout layer 1 lies below start layer 2"):
        validate([Request(tokens=TOKENS, knockout=Knockout((1,), (4,), (0,)), start=Start(2, "s"))],
                 {"s": {"resid.1": torch.zeros(5, 128)}}, shape)
