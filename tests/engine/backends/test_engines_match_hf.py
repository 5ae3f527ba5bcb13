"""The vLLM backend against the Hugging Face reference: one matrix of model families and engine options.

Each row takes one vLLM engine and checks, against hf on the same model:
- every readable site captured, and the attention pattern read from the q and k the kernel receives
  (sliding windows, soft-caps, grouped heads: the kernel's own);
- every site kind the family has patched, at every layer (on Gemma 2's chunked row, the first and
  the last), with noise and knockouts, the whole prompt longer than the tiny models' sliding windows;
- the same runs started mid-stack from the corrupt run's stream (`plan.Start`), which equal both the
  engine's full forward and hf, two patches where the lower decides the start and a capture on the
  started stream included;
- after all of it, no hook left and the decoder starting at layer 0 again: an unpatched run is the
  run before them, bit for bit, and vLLM's own generation samples the model's own argmax.

Rows: the three families the whole suite runs on and every other family (each one's own features are
shown active in test_families.py). Engines that split prompts by chunked prefill: Gemma 2's second row
(sliding and global layers), in this process, and the one row of each family whose engine runs in
processes of its own anyway (experts, and the families vLLM runs through its Transformers backend), which
runs vLLM's multiprocess executor too (test_vllm_scheduling.py takes OLMo 2's again, for every kind of
request crossing to its processes)."""
from __future__ import annotations

import pytest
import torch

from patchgrid.cache import stream_keys
from patchgrid.plan import Patch, Request
from tests.support.backends import (
    all_keys,
    assert_patterns_close,
    assert_results_close,
    effect_spread,
    every_site_requests,
    reading_logprobs,
    starting,
)
from tests.support.engines import (
    CHUNKED,
    OWN_PROCESS_MODELS,
    TINY,
    hook_count,
    needs_vllm,
    own_processes_of,
    start_layers,
    vllm_options,
)

pytestmark = needs_vllm

CLEAN = tuple(range(21, 61))  # 40 tokens: past the tiny models' sliding windows
CORRUPT = CLEAN[:10] + (250, 61) + CLEAN[12:]
ANSWERS = (5, 77)

# Families vLLM runs through its Transformers backend (sites.Family.vllm_transformers): transformers'
# own modules, in an engine process of their own, started mid-stack by stand-ins for the layers below.
TRANSFORMERS_BACKEND = ("tiny-neox", "tiny-olmo2")

# The rows, in an order that starts each engine of a process of its own once here and in test_families.py,
# next (the session's pool keeps three of them alive, and three in the test's process, each kind closing
# the one it used least recently: tests/support/engines.py): the families every other test runs on first,
# then every other family in this process, then Gemma 2 chunked, and last the three families whose engine
# runs in processes of its own anyway, each started once, chunked and multiprocess (vllm_options), which
# test_families.py, test_start_midstack.py and test_paths.py take again.
MATRIX = ([(model, {}) for model in TINY + ("tiny-phi3", "tiny-gemma3", "tiny-gemma2", "tiny-gptj")]
          + [("tiny-gemma2", CHUNKED)]
          + [(model, vllm_options(model)) for model in OWN_PROCESS_MODELS])


def _row_id(row):
    model, options = row
    return model + ("-chunked" if options else "") + ("-multiprocess" if options.get("multiprocess") else "")


@pytest.mark.parametrize(("model", "options"), MATRIX, ids=[_row_id(row) for row in MATRIX])
def test_every_site_matches_hf_full_and_started(engines, model, options):
    hf = engines.get(model, "hf", dtype="float32")
    vl = engines.get(model, "vllm", dtype="float32", **options)
    shape, n_layers = hf.shape, hf.shape.n_layers
    # experts and vLLM's Transformers backend run in processes of their own unasked (backends.vllm.own_processes)
    assert own_processes_of(model, {}) == (model in OWN_PROCESS_MODELS)
    assert vl._inprocess == (not own_processes_of(model, options))
    assert vl.start_midstack, "this family's decoder should start mid-stack"
    plain = Request(tokens=CORRUPT, answers=ANSWERS, capture=("resid.0", "resid.1"))
    before = vl.run([plain])[0]

    cap = Request(tokens=CLEAN, answers=ANSWERS, capture=tuple(all_keys(shape)))
    clean, read = hf.run([cap]), vl.run([cap])
    assert_results_close(clean, read)  # on the chunked rows, captures stitched from several steps
    assert_patterns_close(clean, read, shape.n_heads)  # on the chunked rows, the keys of earlier steps kept
    assert read[0].captures["resid.0"].shape == (len(CLEAN), shape.d_model)
    assert read[0].captures["head.0"].shape == (len(CLEAN), shape.n_heads * shape.head_dim)

    # every layer, but on the second row of a family that runs in this process (Gemma 2's): the first and last
    layers = (0, n_layers - 1) if options and model not in OWN_PROCESS_MODELS else None
    reqs = every_site_requests(shape, CORRUPT, ANSWERS, layers=layers)
    stream = hf.run([Request(tokens=CORRUPT, answers=ANSWERS, capture=stream_keys(n_layers))])[0]
    sources = {"clean": clean[0].captures, "corrupt": stream.captures}
    full = vl.run(reqs, sources)
    assert_results_close(hf.run(reqs, sources), full)
    assert effect_spread(full) > 0.05, "patches barely moved the answer; the comparison would prove little"

    # two patches, the lower deciding the start, and a capture on the started stream
    both = reading_logprobs([Request(tokens=CORRUPT, answers=ANSWERS, capture=("resid.1", "resid.2"),
                                     patches=(Patch("resid", 1, "clean", (2,)), Patch("mlp_out", 2, "clean", (3,))))])
    unstarted = [r for r in reqs if not r.noise] + both
    started = starting(unstarted, n_layers)
    begins = {r.start.layer for r in started if r.start}
    assert begins == set(range(1, n_layers)) if layers is None else {1, n_layers - 1} <= begins
    skipped = vl.run(started, sources)
    assert_results_close(skipped, [f for f, r in zip(full, reqs) if not r.noise] + vl.run(both, sources))
    assert_results_close(skipped, hf.run(started, sources))

    assert hook_count(vl) == 0 and hook_count(hf) == 0 and start_layers(vl) == [0]
    after = vl.run([plain])[0]
    assert torch.equal(before.answer_logits, after.answer_logits)
    for key in plain.capture:
        assert torch.equal(before.captures[key], after.captures[key])
    # during a call vLLM's sampler is handed a zero column (readout.LogitsReadout._idle_sampler); after
    # it, vLLM's own generation samples from the model's logits again: greedy = the reference's argmax
    from vllm import SamplingParams, TokensPrompt

    out = vl.llm.generate([TokensPrompt(prompt_token_ids=list(CLEAN))], SamplingParams(max_tokens=1, temperature=0.0),
                          use_tqdm=False)
    top = hf.run([Request(tokens=CLEAN, answers=ANSWERS, top_k=1)])[0].top_ids
    assert list(out[0].outputs[0].token_ids) == list(top)
