"""The backend tests' shared engine fixture: one Hugging Face and one vLLM engine of a tiny model."""
from __future__ import annotations

import pytest

from tests.support.engines import TINY, vllm_options


def pytest_generate_tests(metafunc):
    """`pair_of_engines` runs over the module's ENGINE_MODELS (default: the tiny models), one model at a time."""
    if "pair_of_engines" in metafunc.fixturenames:
        models = getattr(metafunc.module, "ENGINE_MODELS", TINY)
        metafunc.parametrize("pair_of_engines", models, indirect=True, scope="module")


@pytest.fixture(scope="module")
def pair_of_engines(request, engines):
    """(hf, vllm) engines of one model, float32 both, from the session's pool (the vLLM engine with the
    options the engine tests start the model with: tests/support/engines.py's vllm_options)."""
    model = request.param
    return engines.get(model, "hf", dtype="float32"), engines.get(model, "vllm", dtype="float32",
                                                                   **vllm_options(model))
