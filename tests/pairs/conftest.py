from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tok(tokenizers):
    return tokenizers("smollm2-135m")
