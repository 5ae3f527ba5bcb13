"""--limit N: facts are judged in the data set's order, a batch at a time, and judging stops once the
judged hold N members of every population the study runs; the records not reached are rejected as
limit_reached, and the judged ones are as a build without the limit judges them."""
from __future__ import annotations

import pytest

from patchgrid.pairs import Limit, accepted_pairs, read_source, traced_facts
from patchgrid.pairs.limit import FIRST_BATCH, batches
from tests.support.known import known_facts
from tests.support.pairs import write_jsonl


def _row(pid, status, known):
    return {"pair_id": pid, "status": status, "reason": None if status == "accepted" else "no_partner",
            "usable_alone": True, "known_alone": known, "clean_ids": [1, 2, 3],
            "corrupt_ids": [1, 9, 3] if status == "accepted" else None, "clean_answer_id": 7,
            "corrupt_answer_id": 8 if status == "accepted" else None, "subject_start": 1, "subject_end": 2,
            "roles": ["before_subject", "subject_last", "last"]}


def test_the_limit_is_reached_when_every_population_has_its_members():
    rows = [_row("a", "accepted", False), _row("b", "accepted", False), _row("c", "rejected", True)]
    assert Limit(2).reached(rows)
    assert not Limit(3).reached(rows)
    # a study that traces also needs N facts the model knows alone: two pairs are not enough
    both = Limit(2, (accepted_pairs, traced_facts), ("pairs", "traced facts"))
    assert not both.reached(rows)
    assert both.reached(rows + [None, _row("d", "rejected", True)])  # rows not decided yet are skipped
    reason, detail = both.reason()
    assert reason == "limit_reached" and "not judged" in detail and "2 pairs and 2 traced facts" in detail


def test_batches_start_at_the_limit_and_double():
    order = list(range(100))
    assert [len(b) for b in batches(order, None)] == [100]
    assert [len(b) for b in batches(order, Limit(2))] == [FIRST_BATCH, 2 * FIRST_BATCH, 4 * FIRST_BATCH,
                                                          100 - 7 * FIRST_BATCH]
    assert [len(b) for b in batches(order, Limit(30))] == [30, 60, 10]
    assert [i for b in batches(order, Limit(3)) for i in b] == order  # in the data set's order


@pytest.fixture(scope="module")
def known(engines, tokenizers, tmp_path_factory):
    """60 facts tiny-llama knows, in ROME's known_1000 format, and its engine."""
    engine = engines.get("tiny-llama", "hf", dtype="float32")
    path = write_jsonl(tmp_path_factory.mktemp("known") / "known.jsonl",
                       known_facts(engine, tokenizers("tiny-llama"), 60))
    return read_source(str(path))[1], engine

