"""Plans out of range are refused before anything runs, naming the field."""
from __future__ import annotations

import pytest
import torch

from patchgrid.plan import Noise, Patch, PlanError, Request, Start, decode_tensor, encode_tensor, latest_start, validate
from patchgrid.sites import LLAMA, ModelShape

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
