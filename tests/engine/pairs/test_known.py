"""--require-known: the model's clean log-probability difference positive, corrupt negative (over every
answer token), in batched calls."""
from __future__ import annotations

import pytest

from patchgrid.pairs import build_pairs, read_source
from patchgrid.plan import Request
from tests.support.engines import PRETRAINED_SLOW, needs_vllm
from tests.support.pairs import write_jsonl
from tests.unit.pairs.test_known import DATA


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
        records.append({"id": str(i), "clean_prompt": f"The capital of {a} is",
                        "corrupt_prompt": f"The capital of {b} is",
                        "clean_answer": answers[i], "corrupt_answer": answers[i + 1]})
    _, recs = read_source(str(write_jsonl(tmp_path / "p.jsonl", records)))
    rows = build_pairs(recs, tok, max_len=1024, engine=engine, require_known=True)
    assert engine.calls == 1
    checked = [r for r in rows if r["clean_logprob_diff"] is not None]
    assert checked, "no pair reached the known check"
    for r in checked:
        ans = (r["clean_answer_id"], r["corrupt_answer_id"])
        c, k = engine.engine.run([Request(tokens=tuple(r["clean_ids"]), answers=ans),
                                  Request(tokens=tuple(r["corrupt_ids"]), answers=ans)])
        if r["answer_policy"] == "single":
            assert r["clean_logit_diff"] == pytest.approx(float(c.answer_logits[0] - c.answer_logits[1]), abs=1e-5)
            assert r["corrupt_logit_diff"] == pytest.approx(float(k.answer_logits[0] - k.answer_logits[1]), abs=1e-5)
            # one normaliser for both one-token answers: the logit and log-probability differences agree
            assert r["clean_logprob_diff"] == pytest.approx(r["clean_logit_diff"], abs=1e-5)
        else:
            assert r["clean_logit_diff"] is None and r["corrupt_logit_diff"] is None
        _expect_verdict(r)


def _expect_verdict(r):
    expected = "accepted" if r["clean_logprob_diff"] > 0 and r["corrupt_logprob_diff"] < 0 else "rejected"
    assert r["status"] == expected
    if r["clean_logprob_diff"] <= 0:
        assert r["reason"] == "not_known_clean"
    elif r["corrupt_logprob_diff"] >= 0:
        assert r["reason"] == "not_known_corrupt"


def _assert_logprob_diffs(model, r):
    """A row's recorded log-probability differences against a plain HF forward of each answer."""
    a, b = tuple(r["clean_answer_ids"]), tuple(r["corrupt_answer_ids"])
    clean = _hf_logprob(model, r["clean_ids"], a) - _hf_logprob(model, r["clean_ids"], b)
    corrupt = _hf_logprob(model, r["corrupt_ids"], a) - _hf_logprob(model, r["corrupt_ids"], b)
    assert r["clean_logprob_diff"] == pytest.approx(clean, abs=1e-4)
    assert r["corrupt_logprob_diff"] == pytest.approx(corrupt, abs=1e-4)


def _hf_logprob(model, prompt, answer) -> float:
    """log p(answer | prompt) summed over the answer's tokens, teacher-forced, by a plain HF forward."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(answer[:-1])])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return sum(float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(answer))


# 5-token prompts on tiny-llama; answers of 1 (Paris, Berlin), 3 (Lima), 5 (Abuja, Accra) and 6 tokens
TINY_FACTS = [("France", "Paris"), ("Germany", "Berlin"), ("Japan", "Lima"), ("Italy", "Abuja"),
              ("Spain", "Accra"), ("Egypt", "Canberra"), ("Kenya", "Nairobi")]


def test_full_answers_are_judged_by_their_whole_log_probability(tmp_path, engines, tokenizers):
    from transformers import AutoModelForCausalLM

    from patchgrid.model.models import prepare

    tok = tokenizers("tiny-llama")
    engine = CountingEngine(engines.get("tiny-llama", "hf", dtype="float32"))
    model = AutoModelForCausalLM.from_pretrained(prepare("tiny-llama"), torch_dtype="float32").eval()
    records = [{"id": str(i), "clean_prompt": f"The capital of {a} is", "corrupt_prompt": f"The capital of {b} is",
                "clean_answer": " " + x, "corrupt_answer": " " + y}
               for i, ((a, x), (b, y)) in enumerate(zip(TINY_FACTS, TINY_FACTS[1:]))]
    _, recs = read_source(str(write_jsonl(tmp_path / "p.jsonl", records)))
    rows = build_pairs(recs, tok, max_len=1024, engine=engine, require_known=True)
    assert engine.calls == 1
    assert len([r for r in rows if r["answer_policy"] == "full"]) >= 4
    for r in rows:
        _assert_logprob_diffs(model, r)
        _expect_verdict(r)

    # facts paired by subject swap: the pair chosen is judged the same way
    facts = [{"case_id": i, "requested_rewrite": {"prompt": "The capital of {} is", "relation_id": "P36",
                                                   "subject": s, "target_true": {"str": x}}}
             for i, (s, x) in enumerate(TINY_FACTS)]
    _, recs = read_source(str(write_jsonl(tmp_path / "f.jsonl", facts)))
    # without require_known every fact takes its first partner, and the pair is still measured
    loose = build_pairs(recs, tok, max_len=1024, engine=engine, require_known=False)
    assert [r["status"] for r in loose] == ["accepted"] * len(TINY_FACTS)
    assert "full" in {r["answer_policy"] for r in loose}
    for r in loose:
        _assert_logprob_diffs(model, r)
    # with it, a fact is kept only with a partner judged known both ways; the tiny model knows
    # little, so most are rejected, each for the reason its partners' numbers give
    strict = build_pairs(recs, tok, max_len=1024, engine=engine, require_known=True)
    for r, first in zip(strict, loose):
        if r["status"] == "accepted":
            assert r["clean_logprob_diff"] > 0 > r["corrupt_logprob_diff"]
        elif first["clean_logprob_diff"] > 0 and first["corrupt_logprob_diff"] < 0:
            pytest.fail(f"fact {r['pair_id']}: its first partner is known both ways, yet it is rejected")


@pytest.mark.slow
@needs_vllm
def test_shipped_pairs_known_to_smollm2(engines, tokenizers):
    engine = CountingEngine(engines.get("smollm2-135m", "vllm", **PRETRAINED_SLOW))
    fmt, recs = read_source(str(DATA))
    rows = build_pairs(recs, tokenizers("smollm2-135m"), max_len=engine.shape.max_len, engine=engine,
                       require_known=True)
    # the first call scores every fact's own answer and first candidate; the rest, a few rounds
    assert fmt == "counterfact" and 1 <= engine.calls <= 12
    accepted = [r for r in rows if r["status"] == "accepted"]
    assert len(rows) == len(recs)
    assert len(accepted) >= 1000  # multi-token answers included (749 when they were rejected)
    assert len([r for r in accepted if r["answer_policy"] == "full"]) >= 400
    assert len({r["relation"] for r in accepted}) >= 8
    for r in accepted:
        assert r["clean_logprob_diff"] > 0 > r["corrupt_logprob_diff"]
    france = next(r for r in rows if r["relation"] == "capital" and r["subject"] == "France")
    assert france["status"] == "accepted" and france["known_alone"]

