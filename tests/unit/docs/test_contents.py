"""A page's table of contents (the `- [Section](#anchor)` lines before its first `## ` heading) lists
every section of the page, in order, each linked to its own heading."""
from __future__ import annotations

import re

import pytest

from tests.support.documents import DOCS, name
from tests.unit.docs.test_links import FENCE

ENTRY = re.compile(r"^- \[(.+)\]\(#([^)]+)\)$", re.MULTILINE)


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _contents_and_sections(text: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    text = FENCE.sub("", text)
    first = re.search(r"^## ", text, re.MULTILINE)
    head = text[:first.start()] if first else text
    sections = [(h.strip(), _slug(h)) for h in re.findall(r"^## (.+)$", text, re.MULTILINE)]
    return ENTRY.findall(head), sections


@pytest.mark.parametrize("doc", DOCS, ids=name)
def test_the_contents_list_every_section(doc):
    contents, sections = _contents_and_sections(doc.read_text())
    if not contents:
        return  # a page without a table of contents
    assert [(title, anchor) for title, anchor in contents] == sections, \
        f"{name(doc)}: its contents list {[t for t, _ in contents]}, its sections are {[t for t, _ in sections]}"


def test_a_missing_section_is_found():
    contents, sections = _contents_and_sections("# T\n\n- [A](#a)\n\n## A\n\ntext\n\n## B c\n")
    assert contents == [("A", "a")] and sections == [("A", "a"), ("B c", "b-c")]
