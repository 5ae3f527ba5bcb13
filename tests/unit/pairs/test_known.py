"""--require-known: the model's clean log-probability difference positive, corrupt negative (over every
answer token), in batched calls."""
from __future__ import annotations

import json
from collections import Counter

from tests.support.paths import REPO

DATA = REPO / "data" / "pairs" / "facts.jsonl"


def test_shipped_fact_set_shape():
    records = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    relations = Counter(r["relation"] for r in records)
    assert len(records) >= 400 and len(relations) >= 8
    assert {"capital", "continent", "official_language", "currency"} <= set(relations)
    assert len({r["case_id"] for r in records}) == len(records)

