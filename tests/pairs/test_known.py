"""--require-known: the model's clean logit difference positive, corrupt negative, in one batched call."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from patchgrid.pairs import build_pairs, read_source
from patchgrid.plan import Request
from tests.conftest import needs_vllm

from .conftest import write_jsonl

DATA = Path(__file__).resolve().parents[2] / "data" / "pairs" / "facts.jsonl"


class CountingEngine:
    def __init__(self, engine):
        self.engine, self.calls = engine, 0
        self.shape = engine.shape

    def run(self, requests, sources=None):
        self.calls += 1
        return self.engine.run(requests, sources)


def test_explicit_pairs_known_check_matches_the_engine(tmp_path, engines, tokenizers):
    tok = tokenizers("tiny-llama")
    engine = CountingEngine(engines.get("tiny-llama", "hf", dtype="float32"))
    words = ["France", "Germany", "Japan", "Italy", "Spain", "Egypt", "Russia", "China"]
    answers = [" Paris", " Berlin", " Tokyo", " Rome", " Madrid", " Cairo", " the", " a"]
    records = []
    for i, (a, b) in enumerate(zip(words, words[1:])):
        records.append({"id": str(i), "clean_prompt": f"The capital of {a} is", "corrupt_prompt": f"The capital of {b} is",
                        "clean_answer": answers[i], "corrupt_answer": answers[i + 1]})
    _, recs = read_source(str(write_jsonl(tmp_path / "p.jsonl", records)))
    rows = build_pairs(recs, tok, max_len=1024, engine=engine, require_known=True)
    assert engine.calls == 1
    checked = [r for r in rows if r["clean_logit_diff"] is not None]
    assert checked, "no pair reached the known check"
    for r in checked:
        ans = (r["clean_answer_id"], r["corrupt_answer_id"])
        c, k = engine.engine.run([Request(tokens=tuple(r["clean_ids"]), answers=ans),
                                  Request(tokens=tuple(r["corrupt_ids"]), answers=ans)])
        assert r["clean_logit_diff"] == pytest.approx(float(c.answer_logits[0] - c.answer_logits[1]), abs=1e-5)
        assert r["corrupt_logit_diff"] == pytest.approx(float(k.answer_logits[0] - k.answer_logits[1]), abs=1e-5)
        expected = ("accepted" if r["clean_logit_diff"] > 0 and r["corrupt_logit_diff"] < 0 else "rejected")
        assert r["status"] == expected
        if r["clean_logit_diff"] <= 0:
            assert r["reason"] == "not_known_clean"
        elif r["corrupt_logit_diff"] >= 0:
            assert r["reason"] == "not_known_corrupt"


def test_shipped_fact_set_shape():
    records = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    relations = Counter(r["relation"] for r in records)
    assert len(records) >= 400 and len(relations) >= 8
    assert {"capital", "continent", "official_language", "currency"} <= set(relations)
    assert len({r["case_id"] for r in records}) == len(records)


@pytest.mark.slow
@needs_vllm
def test_shipped_pairs_known_to_smollm2(engines, tokenizers):
    engine = CountingEngine(engines.get("smollm2-135m", "vllm"))
    fmt, recs = read_source(str(DATA))
    rows = build_pairs(recs, tokenizers("smollm2-135m"), max_len=engine.shape.max_len, engine=engine,
                       require_known=True)
    assert fmt == "counterfact" and engine.calls == 1
    accepted = [r for r in rows if r["status"] == "accepted"]
    assert len(rows) == len(recs)
    assert len(accepted) >= 150
    assert len({r["relation"] for r in accepted}) >= 8
    for r in accepted:
        assert r["clean_logit_diff"] > 0 > r["corrupt_logit_diff"]
    france = next(r for r in rows if r["relation"] == "capital" and r["subject"] == "France")
    assert france["status"] == "accepted" and france["known_alone"]
