"""Correct however vLLM schedules: prompts split by chunked prefill, many steps, long prompts; half
the patched runs start mid-stack (plan.Start), mixed in one call with those that do not; a third
score answers of several tokens (long enough to be split across steps) and a KL divergence."""
from __future__ import annotations

import random

import pytest
import torch

from patchgrid.plan import LOGPROBS, Noise, Patch, Request, Start, latest_start
from tests.support.backends import all_keys, assert_results_close, effect_spread
from tests.support.engines import CHUNKED, OWN_PROCESS_MODELS, needs_vllm, vllm_options

pytestmark = needs_vllm
MODEL = "tiny-llama"
ANSWERS = (5, 77)
# answers scored whole: one of 37 tokens (split across chunked-prefill steps), one of 2
CONTINUATIONS = (tuple(range(40, 77)), (77, 4))


def _prompt(rng, n):
    return tuple(rng.randrange(3, 500) for _ in range(n))


def _mixed_requests(shape, rng, corrupts, n):
    reqs = []
    for i in range(n):
        corrupt = corrupts[i % len(corrupts)]
        T = len(corrupt)
        site = rng.choice(["resid", "attn_out", "mlp_out", "head", "embed", "neuron", "resid_pre", "resid_mid",
                           "q", "k", "v"])
        layer = None if site == "embed" else rng.randrange(shape.n_layers)
        head = rng.randrange(shape.units(site)) if site in ("head", "q", "k", "v") else None
        neuron = rng.randrange(shape.d_mlp) if site == "neuron" else None
        positions = tuple(sorted(rng.sample(range(T), k=min(3, T))))
        noise = (Noise((0, 1), 0.5, i),) if i % 7 == 0 else ()
        source = f"clean{i % len(corrupts)}"
        patches = (Patch(site, layer, source, positions, head, neuron),)
        start = latest_start(patches, shape.n_layers)
        start = Start(start, f"corrupt{i % len(corrupts)}") if start and not noise and i % 2 == 0 else None
        scored = dict(continuations=CONTINUATIONS, reference="ref") if i % 3 == 0 else {}
        reqs.append(Request(tokens=corrupt, answers=ANSWERS, noise=noise, patches=patches, start=start, **scored))
    assert any(r.start for r in reqs) and not all(r.start for r in reqs)
    assert any(r.start and r.continuations for r in reqs)
    assert any(p.site == "neuron" for r in reqs for p in r.patches)
    assert {"resid_pre", "resid_mid", "q", "k", "v"} & {p.site for r in reqs for p in r.patches}
    return reqs


@pytest.fixture(scope="module")
def hf(engines):
    return engines.get(MODEL, "hf", dtype="float32")


@pytest.fixture(scope="module")
def chunked(engines):
    # A step holds at most 32 tokens: every prompt below is split across several steps and
    # shares steps with pieces of other prompts.
    return engines.get(MODEL, "vllm", dtype="float32", **CHUNKED)


def _sources(engine, cleans, corrupts=()):
    """The clean runs' captures, and the corrupt runs' (the streams patched runs start from)."""
    keys = tuple(all_keys(engine.shape, pattern=False))  # with answers scored over several forwards
    # the corrupt runs score the answers too: their streams cover the answers' positions
    runs = engine.run([Request(tokens=c, answers=ANSWERS, capture=keys, logprobs=True) for c in cleans] +
                      [Request(tokens=c, answers=ANSWERS, capture=keys, continuations=CONTINUATIONS)
                       for c in corrupts])
    out = {f"clean{i}": r.captures for i, r in enumerate(runs[:len(cleans)])}
    out.update({f"corrupt{i}": r.captures for i, r in enumerate(runs[len(cleans):])})
    out["ref"] = {LOGPROBS: runs[0].logprobs}
    return out


def test_chunked_prefill_split_prompts_match_hf(hf, chunked):
    rng = random.Random(1)
    lengths = [45, 70, 97, 33]
    cleans = [_prompt(rng, n) for n in lengths]
    corrupts = [tuple(c[:5]) + _prompt(rng, 3) + tuple(c[8:]) for c in cleans]
    sources = _sources(hf, cleans, corrupts)
    # captures split across steps are stitched together correctly
    assert_results_close(hf.run([Request(tokens=c, answers=ANSWERS, capture=("resid.2", "head.1")) for c in cleans]),
                         chunked.run([Request(tokens=c, answers=ANSWERS, capture=("resid.2", "head.1"))
                                      for c in cleans]))
    reqs = _mixed_requests(hf.shape, rng, corrupts, 40)
    a, b = hf.run(reqs, sources), chunked.run(reqs, sources)
    assert_results_close(a, b)
    assert effect_spread(b) > 0.05


def test_several_hundred_requests_over_many_steps(hf, engines):
    vl = engines.get(MODEL, "vllm", dtype="float32", max_num_seqs=16)
    rng = random.Random(2)
    cleans = [_prompt(rng, rng.randrange(6, 20)) for _ in range(12)]
    corrupts = [tuple(c[:2]) + _prompt(rng, 2) + tuple(c[4:]) for c in cleans]
    sources = _sources(hf, cleans, corrupts)
    reqs = _mixed_requests(hf.shape, rng, corrupts, 360)
    a, b = hf.run(reqs, sources), vl.run(reqs, sources)
    assert_results_close(a, b)
    assert effect_spread(b) > 0.05


def test_prompts_longer_than_a_kv_block_read_no_stale_kv(hf, engines):
    """Same long prompt patched and unpatched in one call: a prefix cache would mix their KV."""
    vl = engines.get(MODEL, "vllm", dtype="float32")
    rng = random.Random(3)
    clean = _prompt(rng, 300)  # vLLM's CPU KV block is 128 tokens
    corrupt = tuple(clean[:150]) + _prompt(rng, 10) + tuple(clean[160:])
    sources = _sources(hf, [clean])
    reqs = [Request(tokens=corrupt, answers=ANSWERS)]
    reqs += [Request(tokens=corrupt, answers=ANSWERS, patches=(Patch("resid", 1, "clean0", (p,)),))
             for p in (0, 20, 155)]
    reqs += [Request(tokens=corrupt, answers=ANSWERS)]
    a, b = hf.run(reqs, sources), vl.run(reqs, sources)
    assert_results_close(a, b)
    assert torch.equal(b[0].answer_logits, b[-1].answer_logits)
    # The patch where the prompts differ moves the answer; HF agreeing with it (above) shows its
    # KV was not taken from the unpatched copy of the same tokens.
    assert (b[3].answer_logits - b[0].answer_logits).abs().max() > 1e-3


# The engine of vLLM's multiprocess executor: a family whose engine runs in processes of its own anyway, whose
# engine the session has started already (tests/support/engines.py), chunked too.
MULTIPROCESS = OWN_PROCESS_MODELS[-1]


def _multiprocess(engines):
    return (engines.get(MULTIPROCESS, "hf", dtype="float32"),
            engines.get(MULTIPROCESS, "vllm", dtype="float32", **vllm_options(MULTIPROCESS)))


def test_multiprocess_executor_matches_hf(engines):
    hf, vl = _multiprocess(engines)
    assert vllm_options(MULTIPROCESS)["multiprocess"]
    rng = random.Random(4)
    cleans = [_prompt(rng, 12) for _ in range(3)]
    corrupts = [tuple(c[:3]) + _prompt(rng, 2) + tuple(c[5:]) for c in cleans]
    sources = _sources(hf, cleans, corrupts)
    reqs = _mixed_requests(hf.shape, rng, corrupts, 30)
    a, b = hf.run(reqs, sources), vl.run(reqs, sources)
    assert_results_close(a, b)
    # captures cross the process boundary too
    cap = Request(tokens=cleans[0], answers=ANSWERS, capture=("resid.1", "head.2"))
    assert_results_close(hf.run([cap]), vl.run([cap]))


@pytest.mark.parametrize("multiprocess", [False, True], ids=["chunked_prefill", "multiprocess"])
def test_path_patching_matches_hf(hf, chunked, engines, multiprocess):
    """Both passes of path patching (the frozen first pass's captures become the second's
    sources), with prompts and their answers split across steps, or crossing to the engine core's
    process."""
    from patchgrid.pairs.align import position_roles
    from patchgrid.pairs.pair import Pair
    from tests.engine.sweeps.test_paths import assert_rows_close, paths_rows
    from tests.unit.sweeps.test_paths import EVERY

    hf, vl = _multiprocess(engines) if multiprocess else (hf, chunked)
    rng = random.Random(5)
    clean = _prompt(rng, 45)
    corrupt = tuple(clean[:30]) + _prompt(rng, 2) + tuple(clean[32:])
    # answers of several tokens: the first pass's freezes hold the answers' rows too (whole patches)
    pair = Pair("long", None, clean, corrupt, (5, 9, 11), (77, 3), 30, 32, tuple(position_roles(45, 30, 32)))
    config = EVERY.__class__(sweeps=("paths",), path_senders=("heads", "mlp_out"), path_receivers=("logits", "heads"))
    a, _ = paths_rows(hf, config, pair)
    b, _ = paths_rows(vl, config, pair)
    assert_rows_close(a, b)
    assert max(abs(r["effect"]) for r in b) > 0.01
