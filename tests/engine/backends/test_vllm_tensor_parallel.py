"""Tensor parallelism: reads of z gathered across ranks, writes landing on the rank that holds the head;
and, once those are checked, the engine's core killed: the call waiting on it fails instead of hanging.

The engine runs in processes of its own (a core and a rank a core), like the three families that always do
(tests/support/engines.py's OWN_PROCESS_MODELS): the session keeps three such engines alive, so this one,
used here alone, is closed once the file's tests are done, and its file runs after every other backends
file that takes those three (its name sorts after test_vllm_scheduling.py's), so that it pushes out the one
no later test takes."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest

from patchgrid.cache import stream_keys
from patchgrid.plan import LOGPROBS, Request
from tests.support.backends import all_keys, assert_results_close, effect_spread, every_site_requests, starting
from tests.support.engines import needs_vllm, start_layers
from tests.support.processes import engine_cores
from tests.support.workers import all_cores

TP = dict(dtype="float32", tensor_parallel_size=2)


@pytest.fixture(scope="module")
def tp(engines):
    """The engine, and the engine core process it runs in (this process's one started with it)."""
    before = set(engine_cores(os.getpid()))
    with all_cores():  # a rank a core (under `make test` a worker has one of its own)
        engine = engines.get("tiny-llama", "vllm", **TP)
    yield engine, sorted(set(engine_cores(os.getpid())) - before)
    engines.drop("tiny-llama", "vllm", **TP)  # closing it, dead: it must not wait on its processes


@needs_vllm
def test_tensor_parallel_2_on_cpu_matches_hf(engines, tp):
    tp, _ = tp
    hf = engines.get("tiny-llama", "hf", dtype="float32")
    clean = (21, 7, 143, 88, 301, 12, 9, 40)
    corrupt = (21, 7, 250, 61, 301, 12, 9, 40)
    cap = Request(tokens=clean, answers=(5, 77), capture=tuple(all_keys(hf.shape, pattern=False)))
    a, b = hf.run([cap]), tp.run([cap])
    assert_results_close(a, b)  # z gathered from both ranks equals the whole z
    assert b[0].captures["head.2"].shape == (len(clean), hf.shape.n_heads * hf.shape.head_dim)
    reqs = every_site_requests(hf.shape, corrupt, (5, 77), attention=False)  # read on one rank
    want, got = hf.run(reqs, {"clean": a[0].captures}), tp.run(reqs, {"clean": a[0].captures})
    assert_results_close(want, got)  # head writes landed on the rank holding each head
    assert effect_spread(got) > 0.05
    # started mid-stack on every rank: the stream (whole on each rank) and heads at the start layer
    stream = hf.run([Request(tokens=corrupt, answers=(5, 77), capture=stream_keys(hf.shape.n_layers))])[0]
    sources = {"clean": a[0].captures, "corrupt": stream.captures}
    started = starting([r for r in reqs if not r.noise], hf.shape.n_layers)
    assert any(r.start for r in started)
    assert_results_close(hf.run(started, sources), tp.run(started, sources))
    assert start_layers(tp) == [0, 0]
    # answers of several tokens and the KL divergence: every rank unembeds the same rows (the
    # unembedding gathers its vocabulary slices across ranks)
    sources["ref"] = {LOGPROBS: hf.run([dataclasses.replace(cap, logprobs=True)])[0].logprobs}
    scored = [dataclasses.replace(r, continuations=((5, 9, 33), (77, 4)), reference="ref") for r in reqs[:40]]
    assert_results_close(hf.run(scored, sources), tp.run(scored, sources))
    # the answers' logits alone (logit_diff): each rank computes the answers its vocabulary slice holds
    last = hf.shape.vocab_size - 2  # on the second rank's slice
    lean = [dataclasses.replace(r, answers=(5, last), ranks=False, continuations=(), reference=None, top_k=0,
                                logprobs=False) for r in reqs[:40]]
    assert not any(r.reads_vocabulary for r in lean)
    want = hf.run([dataclasses.replace(r, ranks=True) for r in lean], sources)
    got = tp.run(lean, sources)
    assert all(r.logsumexp is None and r.answer_ranks == [] for r in got)
    assert max((x.answer_logits - y.answer_logits).abs().max().item() for x, y in zip(want, got)) <= 1e-4



@needs_vllm
def test_a_killed_engine_core_fails_the_waiting_call_instead_of_hanging(tp):
    """vLLM's sync client, when its engine core process is killed (the OOM killer, say; its ranks die with
    it), shuts its output thread down silently and a waiting generate would wait for ever; patchgrid wakes
    it, and refuses the engine's later calls. (Last in the file: the engine is dead after it.)"""
    engine, cores = tp
    assert cores, "no engine core process of this engine"
    requests = [Request(tokens=tuple(range(3, 200)), answers=(6,)) for _ in range(3000)]
    engine.run(requests[:1])
    timer = threading.Timer(2.0, lambda: [os.kill(pid, signal.SIGKILL) for pid in cores])
    timer.start()
    started = time.monotonic()
    with pytest.raises(Exception, match="EngineCore|engine core process died"):
        engine.run(requests)
    assert time.monotonic() - started < 60
    with pytest.raises(RuntimeError, match="failed in an earlier call"):
        engine.run(requests[:1])
