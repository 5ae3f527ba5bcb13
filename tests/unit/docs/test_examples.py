"""Every Python example in the docs runs, in order, each page in its own namespace (Sybil). They run on
tiny-llama (seeded random weights, built in seconds); an example that needs the pretrained model or
a GPU is marked in its page with `<!-- skip: next "why" -->` and Sybil skips it."""
from __future__ import annotations

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

from tests.support.documents import DOCS, ROOT

SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()], path=str(ROOT))


EXAMPLES = [example for doc in DOCS for example in SYBIL.parse(doc)]


def test_the_docs_hold_examples():
    assert len(EXAMPLES) >= 3

