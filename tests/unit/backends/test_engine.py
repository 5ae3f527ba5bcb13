"""patchgrid.backends.engine: the checks load_engine makes before it starts anything, and EnginePool's reuse,
bound on live engines (least recently used closed first) and clean-up, with stand-in engines."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import patchgrid.backends.engine as engine_module
from patchgrid.backends.engine import EnginePool, load_engine, model_dtype


class StandIn:
    def __init__(self, model, backend, options, log):
        self.key, self.log, self.closed = (model, backend, options), log, False

    def close(self):
        self.closed = True
        self.log.append(("close", *self.key[:2]))


@pytest.fixture
def started(monkeypatch):
    """Every engine the pool starts, in order; the pool starts stand-ins instead of real engines."""
    log = []

    def load(model, backend="vllm", **options):
        log.append(("start", model, backend))
        return StandIn(model, backend, options, log)

    monkeypatch.setattr(engine_module, "load_engine", load)
    return log


def test_an_engine_is_started_once_per_model_backend_and_options(started):
    pool = EnginePool()
    a = pool.get("m", "hf", dtype="float32")
    assert pool.get("m", "hf", dtype="float32") is a
    b = pool.get("m", "hf", dtype="bfloat16")
    c = pool.get("m", "vllm", dtype="float32")
    assert len({id(a), id(b), id(c)}) == 3
    assert started == [("start", "m", "hf"), ("start", "m", "hf"), ("start", "m", "vllm")]
    # options are a set of names, not a sequence
    assert pool.get("m", "vllm", max_model_len=64, dtype="float32") is pool.get("m", "vllm", dtype="float32",
                                                                                max_model_len=64)


def test_without_a_bound_nothing_is_closed_until_the_pool_is(started):
    with EnginePool() as pool:
        engines = [pool.get(f"m{i}", "vllm") for i in range(5)]
        assert not any(e.closed for e in engines)
    assert all(e.closed for e in engines)
    assert pool.live() == []


def test_the_least_recently_used_engine_is_closed_beyond_the_bound(started):
    pool = EnginePool(max_live=2)
    a, b = pool.get("a", "vllm"), pool.get("b", "vllm")
    assert pool.get("a", "vllm") is a  # a is now the more recently used
    c = pool.get("c", "vllm")
    assert b.closed and not a.closed and not c.closed
    assert [k[0] for k in pool.live()] == ["a", "c"]
    # b is started again when asked for, closing a, now the least recently used
    b2 = pool.get("b", "vllm")
    assert b2 is not b and a.closed
    assert [k[0] for k in pool.live()] == ["c", "b"]
    assert started.count(("start", "b", "vllm")) == 2


def test_a_number_bounds_all_backends_together(started):
    pool = EnginePool(max_live=2)
    hf = pool.get("a", "hf")
    pool.get("a", "vllm")
    pool.get("b", "vllm")
    assert hf.closed
    assert [k[:2] for k in pool.live()] == [("a", "vllm"), ("b", "vllm")]


def test_a_bound_per_backend_counts_only_that_backend(started):
    pool = EnginePool(max_live={"vllm": 1})
    hfs = [pool.get(m, "hf") for m in ("a", "b", "c")]
    first = pool.get("a", "vllm")
    second = pool.get("b", "vllm")
    assert first.closed and not second.closed
    assert not any(e.closed for e in hfs)  # hf engines are not bounded
    assert [k[:2] for k in pool.live()] == [("a", "hf"), ("b", "hf"), ("c", "hf"), ("b", "vllm")]


def test_a_dropped_engine_is_closed_and_started_fresh(started):
    pool = EnginePool()
    a = pool.get("m", "vllm", dtype="float32")
    pool.drop("m", "vllm", dtype="float32")
    assert a.closed and pool.live() == []
    assert pool.get("m", "vllm", dtype="float32") is not a
    pool.drop("never-started", "vllm")  # nothing to drop: no error


def test_an_engine_that_fails_to_close_is_still_dropped(started):
    pool = EnginePool(max_live=1)
    dead = pool.get("a", "vllm")

    def fail():
        raise RuntimeError("engine core died")

    dead.close = fail
    pool.get("b", "vllm")
    assert [k[0] for k in pool.live()] == ["b"]


@pytest.mark.parametrize("bound, message", [(0, "max_live must be at least 1, not 0"),
                                            ({"vllm": 0}, "max_live must be at least 1, not 0"),
                                            ({"tpu": 2}, "unknown backend 'tpu' in max_live")])
def test_bad_bounds_are_refused(bound, message):
    with pytest.raises(ValueError, match=message):
        EnginePool(max_live=bound)


@pytest.mark.parametrize("kw, message", [(dict(backend="onnx"), "unknown backend 'onnx'; use one of vllm, hf"),
                                         (dict(dtype="int8"), "unknown dtype 'int8'; use one of auto, float32")])
def test_load_engine_refuses_unknown_backends_and_dtypes_before_loading_anything(kw, message, monkeypatch):
    monkeypatch.setattr(engine_module, "prepare", lambda model: pytest.fail("prepared a model"))
    with pytest.raises(ValueError, match=message):
        load_engine("tiny-llama", **kw)


@pytest.mark.parametrize("config, dtype", [(SimpleNamespace(dtype=torch.bfloat16), "bfloat16"),
                                           (SimpleNamespace(dtype=None, torch_dtype="torch.float16"), "float16"),
                                           (SimpleNamespace(), "float32")])
def test_the_checkpoint_dtype_is_read_from_the_config(config, dtype):
    assert model_dtype(config) == dtype


def test_the_cyclic_collector_is_paused_for_a_vllm_call_and_resumes_however_it_ends():
    import gc

    from patchgrid.runtime.collector import cyclic_gc_paused

    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), cyclic_gc_paused():
        raise RuntimeError("a step failed")
    assert gc.isenabled()
    gc.disable()  # paused by the caller: left so
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
