"""Facts a tiny test model knows, for tests that need the knowledge check to accept pairs (the tiny
models know none of the shipped facts both ways): each subject's prompt with the model's own top-1
prediction as its answer. Two such facts of one template, subjects as many tokens long and answers
different, make a pair the model knows both ways: its clean answer is the clean prompt's top
token, its corrupt answer the corrupt prompt's."""
from __future__ import annotations

from collections import Counter, defaultdict

from patchgrid.pairs import read_source
from patchgrid.pairs.align import Rejection
from patchgrid.pairs.facts import fact_of
from patchgrid.pairs.sources import Record
from patchgrid.plan import Request
from tests.support.pairs import DATA

TEMPLATE = "The capital of {} is"


def known_facts(engine, tokenizer, n: int) -> list[dict]:
    """`n` facts in ROME's known_1000 format that `engine`'s model knows (its top-1 prediction is
    the answer), all with subjects of one token length, at least two answers among any 8 in a row."""
    _, records = read_source(str(DATA))
    subjects = sorted({r.subject for r in records})
    prompts = [tuple(tokenizer(TEMPLATE.format(s))["input_ids"]) for s in subjects]
    results = engine.run([Request(tokens=p, answers=(0,), top_k=1) for p in prompts])
    by_length = defaultdict(list)
    for subject, result in zip(subjects, results):
        top = result.top_ids[0]
        answer = tokenizer.decode([top]).strip()  # known_1000's answers carry no leading space
        if not answer:
            continue
        try:
            fact = fact_of(tokenizer, Record("", 0, "P36", subject, TEMPLATE, answer), "full", 1024)
        except Rejection:
            continue
        if fact.answer_ids == (top,):  # the answer read back is the model's own prediction
            by_length[fact.prompt.span[1] - fact.prompt.span[0]].append((subject, answer))
    facts = max(by_length.values(), key=len)
    if len(facts) < n or len(Counter(a for _, a in facts)) < 2:
        raise AssertionError(f"the model knows too few facts of one subject length ({len(facts)}) for {n}")
    facts = _mixed(facts)[:n]
    return [{"known_id": k, "subject": s, "attribute": a, "template": TEMPLATE, "prediction": a,
             "prompt": TEMPLATE.format(s), "relation_id": "P36"} for k, (s, a) in enumerate(facts)]


def _mixed(facts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The facts, answers taken in turn (so that each fact finds a partner with another answer early)."""
    by_answer = defaultdict(list)
    for s, a in facts:
        by_answer[a].append((s, a))
    out = []
    while any(by_answer.values()):
        for a in sorted(by_answer):
            if by_answer[a]:
                out.append(by_answer[a].pop(0))
    return out
