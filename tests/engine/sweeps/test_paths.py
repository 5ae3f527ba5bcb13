"""Path patching (patchgrid.sweeps.paths): the paths sweep on vLLM equals the hf reference on every
family, and equals an independent construction (the sender's difference added to the stream through
its own output projection) on the reference."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from patchgrid.cache import MemoryStore
from patchgrid.model.sites import get_module, site_module
from patchgrid.plan import Patch, Request
from patchgrid.sweeps import cache_spec, run_sweeps
from tests.support.engines import TINY, needs_vllm, vllm_options
from tests.unit.sweeps.test_paths import CLEAN, CORRUPT, EVERY, PAIR

TOL = 1e-4


def paths_rows(engine, config=EVERY, pair=PAIR):
    store = MemoryStore(engine, [pair], cache_spec(config, engine.shape.n_layers))
    return run_sweeps(engine, [pair], store, config), store


def assert_rows_close(a, b, tol=TOL):
    assert [(r["sender"], r["receiver"], r["position"]) for r in a] == \
        [(r["sender"], r["receiver"], r["position"]) for r in b]
    metric = a[0]["metric"] if a else "logit_diff"
    for x, y in zip(a, b):
        d = abs(x[f"patched_{metric}"] - y[f"patched_{metric}"])
        assert d <= tol, f"{x['sender']} -> {x['receiver']} at {x['position']}: differs by {d}"


@needs_vllm
@pytest.mark.parametrize("model", TINY + ("tiny-gemma2", "tiny-gptj", "tiny-neox"))  # post-norms; parallel blocks
def test_paths_on_vllm_equal_the_hf_reference(engines, model):
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32", **vllm_options(model))
    a, _ = paths_rows(hf)
    b, _ = paths_rows(vl)
    assert {r["receiver"][0] for r in b} == {"l", "q", "k", "v"}
    assert_rows_close(a, b)
    effects = [r["effect"] for r in b if r["effect"] is not None]
    assert max(effects) - min(effects) > 0.05, "paths barely moved the answer; the comparison would prove little"


def _head_difference(hf, layer, head, pos):
    """The head's clean minus corrupt contribution to the stream at `pos`: its slice of z through
    the output projection alone (without the bias), made with the model's own module."""
    shape = hf.shape
    o_proj = site_module(hf.model, shape.family, "head", layer)
    cols = slice(head * shape.head_dim, (head + 1) * shape.head_dim)
    out = []
    for tokens in (CLEAN, CORRUPT):
        z = torch.zeros(1, shape.n_heads * shape.head_dim)
        captured = hf.run([Request(tokens=tokens, capture=(f"head.{layer}",))])[0].captures
        z[0, cols] = captured[f"head.{layer}"][pos, cols]
        with torch.no_grad():
            out.append(o_proj(z) - o_proj(torch.zeros_like(z)))
    return (out[0] - out[1])[0]


@pytest.mark.parametrize("model", TINY)
def test_direct_paths_equal_the_senders_difference_added_to_the_stream(engines, model):
    """On the reference, without freezing anything: the head's difference (its z through W_O)
    added to the final stream gives the path to the logits; added to the stream entering a later
    layer, the q, k and v read there, patched into the corrupt run alone, give the paths to that
    layer's heads."""
    hf = engines.get(model, "hf", dtype="float32")
    shape = hf.shape
    S, h, L, H = 0, 2, 2, 3
    config = dataclasses.replace(EVERY, path_senders=(f"head.{S}.{h}",), path_receivers=("logits", f"head.{L}.{H}"))
    rows, store = paths_rows(hf, config)
    corrupt = store.captures(PAIR.pair_id, "corrupt")
    checked = 0
    for pos in (3, 7):
        delta = _head_difference(hf, S, h, pos)
        # to the logits: the final norm reads the corrupt stream plus the difference
        final = get_module(hf.model, shape.family.final_norm)

        def add(module, args, delta=delta, pos=pos):
            x = args[0].clone()
            x[0, pos] += delta.to(x.dtype)
            return (x,) + args[1:]
        handle = final.register_forward_pre_hook(add)
        try:
            with torch.no_grad():
                logits = hf.model(input_ids=torch.tensor([CORRUPT])).logits[0, -1]
        finally:
            handle.remove()
        want = float(logits[5] - logits[77])
        got = next(r for r in rows if r["receiver"] == "logits" and r["position"] == pos)
        assert abs(got["patched_logit_diff"] - want) <= TOL
        # to the receiver's inputs: its q, k, v from the corrupt stream entering L plus the difference
        entering = corrupt[f"resid.{L - 1}"].clone()
        entering[pos] += delta.to(entering.dtype)
        keys = tuple(f"{s}.{L}" for s in ("q", "k", "v"))
        read = hf.run([Request(tokens=CORRUPT, patches=(Patch("resid_pre", L, "mod"),), capture=keys)],
                      {"mod": {f"resid_pre.{L}": entering}})[0].captures
        group = shape.n_heads // shape.kv_heads
        for site, unit in (("q", H), ("k", H // group), ("v", H // group)):
            res = hf.run([Request(tokens=CORRUPT, answers=(5, 77), patches=(Patch(site, L, "read", (pos,), unit),))],
                         {"read": read})[0]
            got = next(r for r in rows if r["receiver"] == f"{site}.{L}.{unit}" and r["position"] == pos)
            assert abs(got["patched_logit_diff"] - float(res.answer_logits[0] - res.answer_logits[1])) <= TOL
            checked += 1
    assert checked == 6
    assert max(abs(r["effect"]) for r in rows) > 1e-3


@needs_vllm
def test_last_layer_paths_to_the_logits_equal_patching_directly(engines):
    """Nothing lies between the last layer's MLP output and the logits; between its attention
    output and the logits lies only that layer's MLP, which the full procedure recomputes (so the
    path equals patching attn_out) and the direct one freezes (attn_out patched, mlp_out held)."""
    vl = engines.get("tiny-llama", "vllm", dtype="float32")
    last = vl.shape.n_layers - 1
    for mlps in ("frozen", "recomputed"):
        config = dataclasses.replace(EVERY, path_senders=(f"attn_out.{last}", f"mlp_out.{last}"),
                                     path_receivers=("logits",), path_mlps=mlps)
        rows, store = paths_rows(vl, config)
        for r in rows:
            pos = None if r["position"] is None else (r["position"],)
            patches = [Patch(r["site"], last, "clean", pos)]
            if r["site"] == "attn_out" and mlps == "frozen":
                patches.append(Patch("mlp_out", last, "corrupt"))
            sources = {run: store.captures(PAIR.pair_id, run) for run in ("clean", "corrupt")}
            res = vl.run([Request(tokens=CORRUPT, answers=(5, 77), patches=tuple(patches))], sources)[0]
            assert abs(r["patched_logit_diff"] - float(res.answer_logits[0] - res.answer_logits[1])) <= 1e-5


@needs_vllm
def test_a_zero_difference_reaches_a_receiver_as_the_baseline_bit_for_bit(engines):
    """A sender at a position before the prompts differ changes nothing: run anyway (start_midstack off),
    each receiver's input is patched with exactly the corrupt run's own, and every reading is the
    corrupt run's, bit for bit."""
    vl = engines.get("tiny-llama", "vllm", dtype="float32")
    config = dataclasses.replace(EVERY, positions=(1,), path_senders=("head.0.1", "attn_out.1"),
                                 path_receivers=("heads",), start_midstack=False)
    rows, store = paths_rows(vl, config)
    corrupt = store.baselines[PAIR.pair_id]
    assert len(rows) == (3 + 2) * 8  # receivers in layers 1-3 (head.0.1) and 2-3 (attn_out.1), 4 q + 2 k + 2 v each
    for r in rows:
        assert r["patched_logit_diff"] == corrupt["corrupt_logit_diff"], (r["sender"], r["receiver"])
        assert r["patched_kl"] == corrupt["corrupt_kl"] and r["effect"] == 0.0


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_paths_to_the_logits_of_answers_of_several_tokens_stay_direct(engines, model):
    """With answers scored whole the request runs past the prompt: its freezes hold those rows too,
    so the sender's difference reaches the scored answer tokens only straight through the final
    stream at the patched position (the reference: the corrupt run with that difference added to the
    last layer's output there, which changes nothing else)."""
    hf = engines.get(model, "hf", dtype="float32")
    pair = dataclasses.replace(PAIR, clean_answer_ids=(5, 9, 11), corrupt_answer_ids=(77, 3))
    config = dataclasses.replace(EVERY, path_senders=("head.0.2", "mlp_out.1"), path_receivers=("logits",),
                                 positions=(3, 7))
    rows, store = paths_rows(hf, config, pair)
    assert {r["metric"] for r in rows} == {"logprob_diff"}
    corrupt = store.captures(pair.pair_id, "corrupt")
    clean_caps = store.captures(pair.pair_id, "clean")
    last = f"resid.{hf.shape.n_layers - 1}"
    ending = hf.run([Request(tokens=pair.corrupt_ids, continuations=pair.continuations, capture=(last,))])[0]
    for r in rows:
        pos = r["position"]
        if r["site"] == "head":
            delta = _head_difference(hf, 0, 2, pos)
        else:
            delta = (clean_caps["mlp_out.1"][pos] - corrupt["mlp_out.1"][pos]).float()
        final = ending.captures[last].clone()
        final[pos] += delta.to(final.dtype)
        want = hf.run([Request(tokens=pair.corrupt_ids, answers=(5, 77), continuations=pair.continuations,
                               patches=(Patch("resid", hf.shape.n_layers - 1, "mod", (pos,)),))],
                      {"mod": {last: final}})[0]
        logprob_diff = sum(want.continuation_logprobs[0]) - sum(want.continuation_logprobs[1])
        assert abs(r["patched_logprob_diff"] - logprob_diff) <= TOL, (r["sender"], pos)
    assert max(abs(r["effect"]) for r in rows) > 1e-3


def test_paths_to_the_logits_from_a_position_but_the_last_are_zero_and_never_run(engines, monkeypatch):
    """The stream carries a sender's change only at its own position and everything after the sender
    is frozen, so a path to the logits (read at the last position) from any other position is zero by
    construction: its reading is the corrupt run's exactly, and no first pass runs for it unless a
    path to a later head needs its captures."""
    hf = engines.get("tiny-llama", "hf", dtype="float32")
    ran = []

    def counted(requests, sources=None, run=hf.run):
        ran.extend(requests)
        return run(requests, sources)

    monkeypatch.setattr(hf, "run", counted)
    last = len(CORRUPT) - 1
    config = dataclasses.replace(EVERY, path_senders=("head.0.1", "mlp_out.1"), path_receivers=("logits",),
                                 positions=tuple(range(len(CORRUPT))))
    rows, store = paths_rows(hf, config)
    corrupt = store.baselines[PAIR.pair_id]["corrupt_logit_diff"]
    ran_at = sorted({p.positions for r in ran for p in r.patches if not p.whole})
    assert ran_at == [(last,)]  # positions 0-1 precede the first change; 2-6 are known without a run
    assert len(rows) == 2 * len(CORRUPT)
    for r in rows:
        if r["position"] != last:
            assert r["patched_logit_diff"] == corrupt and r["effect"] == 0.0, (r["sender"], r["position"])
    assert all(abs(r["effect"]) > 1e-4 for r in rows if r["position"] == last)
    # with a path to a later head the first pass runs at every changed position, for its captures,
    # and the path to the logits stays the corrupt run's
    ran.clear()
    config = dataclasses.replace(config, path_receivers=("logits", "head.3.0"), path_inputs=("q",))
    rows, _ = paths_rows(hf, config)
    assert {r["effect"] for r in rows if r["receiver"] == "logits" and r["position"] != last} == {0.0}
    firsts = [r for r in ran if r.capture]
    assert sorted({p.positions for r in firsts for p in r.patches if not p.whole}) == [(k,) for k in range(2, 8)]

