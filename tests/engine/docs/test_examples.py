"""Every Python example in the docs runs, in order, each page in its own namespace (Sybil). They run on
tiny-llama (seeded random weights, built in seconds); an example that needs the pretrained model or
a GPU is marked in its page with `<!-- skip: next "why" -->` and Sybil skips it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.documents import name
from tests.unit.docs.test_examples import EXAMPLES


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{name(Path(e.path))}:{e.line}" for e in EXAMPLES])
def test_the_example_runs(example):
    example.evaluate()

