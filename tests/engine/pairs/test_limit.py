"""--limit N: facts are judged in the data set's order, a batch at a time, and judging stops once the
judged hold N members of every population the study runs; the records not reached are rejected as
limit_reached, and the judged ones are as a build without the limit judges them."""
from __future__ import annotations

from patchgrid.pairs import Limit, build_pairs
from patchgrid.pairs.limit import FIRST_BATCH
from patchgrid.runtime.progress import reporting_to


class CountingEngine:
    """The engine, with every prompt it is asked to score."""

    def __init__(self, engine):
        self.engine, self.shape, self.prompts = engine, engine.shape, []

    def run(self, requests, sources=None):
        self.prompts += [r.tokens for r in requests]
        return self.engine.run(requests, sources)


def test_limit_judges_only_the_facts_it_needs(known, tokenizers):
    records, engine = known
    tok = tokenizers("tiny-llama")
    whole = CountingEngine(engine)
    full = build_pairs(records, tok, max_len=1024, engine=whole, require_known=True)
    assert len([r for r in full if r["status"] == "accepted"]) >= 10  # the model knows these facts
    told = []
    limited = CountingEngine(engine)
    with reporting_to(lambda *a: told.append(a)):
        rows = build_pairs(records, tok, max_len=1024, engine=limited, require_known=True, limit=Limit(2))
    assert len(rows) == len(records)  # every record read keeps its row
    judged = [r for r in rows if r["reason"] != "limit_reached"]
    # the first batch (8 facts) holds 2 accepted pairs: judging stops there
    assert len(judged) == FIRST_BATCH and len([r for r in judged if r["status"] == "accepted"]) >= 2
    assert [r["pair_id"] for r in judged] == [r["pair_id"] for r in full[:FIRST_BATCH]]  # in the data set's order
    # the facts judged are judged as a build without the limit judges them
    assert [(r["status"], r["reason"], r["corrupt_subject"]) for r in judged] == [
        (r["status"], r["reason"], r["corrupt_subject"]) for r in full[:FIRST_BATCH]]
    # the model was asked about the facts judged and their partners only: two prompts a fact at most
    assert len(set(limited.prompts)) <= 2 * FIRST_BATCH < len(set(whole.prompts))
    for r in rows[FIRST_BATCH:]:
        assert (r["status"], r["reason"]) == ("rejected", "limit_reached") and "not judged" in r["detail"]
        assert r["known_alone"] is None and r["clean_ids"]  # never asked; its prompt still aligned
    # the caller is told facts judged of all, and the pairs accepted so far
    assert told[0] == ("judging facts", 0, len(records), "")
    stage, done, total, note = told[-1]
    assert (stage, done, total) == ("judging facts", FIRST_BATCH, len(records)) and note.endswith("pairs accepted")

