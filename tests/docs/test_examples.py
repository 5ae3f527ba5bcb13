"""Every Python example in the docs runs, in order, each page in its own namespace (Sybil). They run on
tiny-llama (seeded random weights, built in seconds); an example that needs the pretrained model or
a GPU is marked in its page with `<!-- skip: next "why" -->` and Sybil skips it."""
from __future__ import annotations

from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

from tests.docs.documents import DOCS, ROOT, name

SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()], path=str(ROOT))
EXAMPLES = [example for doc in DOCS for example in SYBIL.parse(doc)]


@pytest.mark.engine  # the examples start engines (the hf backend) in this process
@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{name(Path(e.path))}:{e.line}" for e in EXAMPLES])
def test_the_example_runs(example):
    example.evaluate()


def test_the_docs_hold_examples():
    assert len(EXAMPLES) >= 3
