"""What the vLLM worker writes into activations lives where the activations live, checked on any
machine. On a GPU, a patch value, noise, start stream or row index built on the CPU and written into
its CUDA activations fails, or copies once per hook: here the worker's real write path
(vllm_worker.session.Session: its step planning and every hook) runs with activations on PyTorch's
`meta` device, so that a tensor left on the CPU is caught, and a write from another device is refused
by name; so are a request that is not its plan's length or, in a call started mid-stack, of no plan
of the call's (a request's id names its call and plan). The whole engine on a GPU:
tests/engine/backends/test_devices.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from patchgrid.backends.vllm_worker.held import plan_indices, request_id
from patchgrid.backends.vllm_worker.hooks import put
from patchgrid.backends.vllm_worker.session import Session as _Session
from patchgrid.model.models import prepare
from patchgrid.model.sites import LLAMA
from patchgrid.plan import Noise, Patch, Request, Start, encode_tensor, forwards, to_columns

CORRUPT = (21, 7, 250, 61, 301, 12, 9, 40)


ANSWERS = (5, 77)


def _runner(model, requests):
    """The parts of vLLM's V1 runner the worker reads, for one step holding every request whole."""
    lengths = [len(r.tokens) for r in requests]
    ids = [f"{request_id(0, i)}-0a1b2c3d" for i in range(len(requests))]  # as vLLM suffixes the ids given
    return SimpleNamespace(
        get_model=lambda: model,
        input_batch=SimpleNamespace(num_reqs=len(requests), req_ids=ids,
                                    num_computed_tokens_cpu=np.zeros(len(requests), dtype=np.int64)),
        query_start_loc=SimpleNamespace(np=np.cumsum([0] + lengths)),
        requests={rid: SimpleNamespace(prompt_token_ids=list(r.tokens)) for rid, r in zip(ids, requests)},
    ), sum(lengths), to_columns(requests, [forwards(r) for r in requests])


def test_a_vllm_request_id_names_its_call_and_plan():
    assert plan_indices([request_id(7, 12)], 7) == [12]
    assert plan_indices([f"{request_id(7, 12)}-0a1b2c3d", request_id(7, 3)], 7) == [12, 3]  # vLLM's suffix
    assert plan_indices([f"{request_id(7, 12)}-0a1b2c3d"], 8) == [-1]  # another call's
    assert plan_indices(["12-0a1b2c3d", "pg7.x"], 7) == [-1, -1]  # no patchgrid call's


def test_every_write_of_a_step_is_on_the_activations_device():
    from transformers import AutoConfig, AutoModelForCausalLM

    from patchgrid.model.sites import shape_of

    folder = prepare("tiny-llama")
    shape = shape_of(AutoConfig.from_pretrained(folder))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("meta")
    model.logits_processor = torch.nn.Identity()  # where vLLM's logits hook sits
    model.model.start_layer = 0  # vLLM's decoder attribute
    d, z = shape.d_model, shape.n_heads * shape.head_dim
    source = {"resid.1": torch.randn(8, d), "attn_out.2": torch.randn(8, d), "head.2": torch.randn(8, z),
              "embed": torch.randn(8, d), "neuron.3": torch.randn(8, shape.d_mlp)}
    wire = {"clean": {k: encode_tensor(v) for k, v in source.items()},
            "corrupt": {"resid.1": encode_tensor(source["resid.1"])}}
    dims = {"vocab_size": shape.vocab_size, "d_model": d, "n_heads": shape.n_heads, "head_dim": shape.head_dim,
            "d_mlp": shape.d_mlp}
    requests = [
        Request(tokens=CORRUPT, answers=ANSWERS, start=Start(2, "corrupt"),
                patches=(Patch("resid", 1, "clean", (3,)), Patch("attn_out", 2, "clean", (1, 4)),
                         Patch("head", 2, "clean", (5,), 1))),
        Request(tokens=CORRUPT, answers=ANSWERS, noise=(Noise((2, 3), 0.5, 1),), start=Start(2, "corrupt"),
                patches=(Patch("head", 2, "clean", None, 3), Patch("neuron", 3, "clean", (2,), neuron=7))),
    ]
    runner, n_rows, plans = _runner(model, requests)
    session = _Session(runner, wire, ["resid.1", "attn_out.2", "head.2", "neuron.3"], LLAMA, dims, start_layer=2,
                       call=0, plans=plans)
    try:
        assert session.device == torch.device("meta")
        session._begin_step(None, ())
        step = session.step
        written = [t for v in step.writes.values() for t in v] + [t for v in step.units.values() for t in v]
        written += list(step.noise) + list(step.start)
        assert len(written) == 14 and all(t.device.type == "meta" for t in written)
        # every hook, on activations on the meta device: put() refuses a tensor from elsewhere
        def meta(*shape, dtype=torch.float32):
            return torch.zeros(*shape, device="meta", dtype=dtype)

        session._on_embed(None, (), meta(n_rows, d))
        args = session._on_start(None, (meta(n_rows, dtype=torch.long), meta(n_rows, d), None))
        assert args[1].device.type == "meta" and args[2] is None
        session._make_out_hook("attn_out.2")(None, (), meta(n_rows, d))
        session._make_input_hook("head.2")(None, (meta(n_rows, z),))
        session._make_input_hook("neuron.3")(None, (meta(n_rows, shape.d_mlp),))
        session._make_split_stream_hook("resid.1")(None, (), (meta(n_rows, d), meta(n_rows, d)))
        assert model.model.start_layer == 2
    finally:
        session.remove()
    assert model.model.start_layer == 0


def test_a_request_whose_length_is_not_its_plans_or_of_no_plan_in_a_started_call_is_refused():
    """The plan a vLLM request's id names is checked the first time a step sees it: its length is the
    request's, and in a call that starts mid-stack every request is one of the call's, starting there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from patchgrid.model.sites import shape_of

    folder = prepare("tiny-llama")
    shape = shape_of(AutoConfig.from_pretrained(folder))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("meta")
    model.logits_processor = torch.nn.Identity()
    model.model.start_layer = 0
    dims = {"vocab_size": shape.vocab_size, "d_model": shape.d_model, "n_heads": shape.n_heads,
            "head_dim": shape.head_dim, "d_mlp": shape.d_mlp}
    wire = {"corrupt": {"resid.1": encode_tensor(torch.randn(8, shape.d_model))}}
    requests = [Request(tokens=CORRUPT, answers=ANSWERS), Request(tokens=CORRUPT[:6], answers=ANSWERS)]
    runner, _, plans = _runner(model, requests)
    runner.requests[runner.input_batch.req_ids[1]].prompt_token_ids = list(CORRUPT)  # 8 tokens, its plan 6
    session = _Session(runner, wire, [], LLAMA, dims, call=0, plans=plans)
    try:
        with pytest.raises(RuntimeError, match=r"request pg0\.1-0a1b2c3d has 8 tokens, its plan 6"):
            session._begin_step(None, ())
    finally:
        session.remove()
    started = [Request(tokens=CORRUPT, answers=ANSWERS, start=Start(2, "corrupt"))] * 2
    runner, _, plans = _runner(model, started)
    runner.input_batch.req_ids[1] = "another-0a1b2c3d"  # a request of no patchgrid call
    runner.requests["another-0a1b2c3d"] = runner.requests.pop(f"{request_id(0, 1)}-0a1b2c3d")
    session = _Session(runner, wire, [], LLAMA, dims, start_layer=2, call=0, plans=plans)
    try:
        with pytest.raises(RuntimeError, match="request another-0a1b2c3d does not start at layer 2"):
            session._begin_step(None, ())
    finally:
        session.remove()
    assert model.model.start_layer == 0


def test_a_write_from_another_device_is_refused():
    with pytest.raises(RuntimeError, match="writes a tensor on cpu into activations on meta"):
        put(torch.zeros(4, 2, device="meta"), torch.tensor([0]), torch.zeros(1, 2), "resid.1")
    with pytest.raises(RuntimeError, match="resid.1 writes a tensor on cpu"):
        put(torch.zeros(4, 2, device="meta"), torch.tensor([0], device="meta"), torch.zeros(1, 2), "resid.1")

