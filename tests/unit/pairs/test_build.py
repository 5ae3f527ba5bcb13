"""Pairing and alignment: each failure has its reason code; every record appears in the output."""
from __future__ import annotations

import pytest

from patchgrid.pairs import (
    accepted_pairs,
    build_pairs,
    position_roles,
    read_pairs,
    read_source,
    summary,
    write_pairs,
)
from tests.support.pairs import cf, write_jsonl

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Egypt", "Cairo"), ("Russia", "Moscow"), ("China", "Beijing")]


def rows_for(tmp_path, tok, records, fmt=None, **kw):
    _, recs = read_source(str(write_jsonl(tmp_path / "in.jsonl", records)), fmt)
    return build_pairs(recs, tok, max_len=kw.pop("max_len", 2048), **kw)


def test_roles():
    assert position_roles(8, 2, 5) == ["before_subject", "before_subject", "subject_first", "subject_middle",
                                       "subject_last", "after_subject", "further", "last"]
    assert position_roles(5, 3, 4) == ["before_subject"] * 3 + ["subject_last", "last"]
    assert position_roles(3, 0, 2) == ["subject_first", "subject_last", "last"]
    assert position_roles(2, 0, 2) == ["subject_first", "last"]  # the last position is always last


def test_subject_swap_pairs_line_up(tmp_path, tok):
    rows = rows_for(tmp_path, tok, [cf(i, s, a) for i, (s, a) in enumerate(CAPITALS)])
    assert [r["status"] for r in rows] == ["accepted"] * len(CAPITALS)
    for r in rows:
        assert r["corrupt_prompt"] != r["clean_prompt"] and r["corrupt_prompt"].startswith("The capital of ")
        assert len(r["clean_ids"]) == len(r["corrupt_ids"]) == len(r["roles"])
        s, e = r["subject_start"], r["subject_end"]
        assert all(a == b for p, (a, b) in enumerate(zip(r["clean_ids"], r["corrupt_ids"])) if not s <= p < e)
        assert r["clean_answer_id"] != r["corrupt_answer_id"]
        assert r["roles"][-1] == "last" and r["roles"][e - 1] == "subject_last"
        assert r["usable_alone"] and r["answer_policy"] == "single"
    france = rows[0]
    assert france["clean_ids"] == [504, 3575, 282, 4649, 314] and france["clean_answer_id"] == 7042


def test_pairing_is_seeded_and_deterministic(tmp_path, tok):
    records = [cf(i, s, a) for i, (s, a) in enumerate(CAPITALS)]
    a = rows_for(tmp_path, tok, records, seed=1)
    b = rows_for(tmp_path, tok, records, seed=1)
    c = rows_for(tmp_path, tok, records, seed=2)
    assert [r["corrupt_prompt"] for r in a] == [r["corrupt_prompt"] for r in b]
    assert [r["corrupt_prompt"] for r in a] != [r["corrupt_prompt"] for r in c]


def test_fact_level_rejections(tmp_path, tok):
    records = [cf(0, "France", "Paris"), cf(1, "Germany", "Berlin"),
               cf(2, "United Arab Emirates", "Abu Dhabi"),  # two-token answer
               cf(3, "Kazakhstan", "Nur-Sultan"),
               cf(4, "Italy", "Paris"),  # partner candidates must differ in answer
               cf(5, "Peru", "Lima", prompt="The capital of {} is", relation="other")]  # alone in its relation
    rows = rows_for(tmp_path, tok, records, answer_policy="single")
    by = {r["pair_id"]: r for r in rows}
    assert by["2"]["reason"] == "answer_multi_token" and "'Abu Dhabi' is 4 tokens" in by["2"]["detail"]
    assert by["5"]["reason"] == "no_partner"
    assert by["5"]["usable_alone"]  # still usable alone, for causal tracing
    assert by["0"]["status"] == "accepted" and by["0"]["corrupt_answer"] != "Paris"
    assert len(rows) == len(records)


# one-token subjects; answers of one (Paris, Berlin) and two tokens (Abuja, Accra) on smollm2
MIXED = [("France", "Paris"), ("Germany", "Berlin"), ("Nigeria", "Abuja"), ("Ghana", "Accra")]


def test_multi_token_answers_are_scored_whole_by_default(tmp_path, tok):
    rows = rows_for(tmp_path, tok, [cf(i, s, a) for i, (s, a) in enumerate(MIXED)])
    assert [r["status"] for r in rows] == ["accepted"] * 4
    for r in rows:
        clean = tok.encode(" " + r["clean_answer"], add_special_tokens=False)
        corrupt = tok.encode(" " + r["corrupt_answer"], add_special_tokens=False)
        assert r["clean_answer_ids"] == clean and r["corrupt_answer_ids"] == corrupt
        assert (r["clean_answer_id"], r["corrupt_answer_id"]) == (clean[0], corrupt[0])
        assert r["answer_policy"] == ("single" if len(clean) == len(corrupt) == 1 else "full")
    nigeria = rows[2]
    assert [tok.decode([t]) for t in nigeria["clean_answer_ids"]] == [" Abu", "ja"]
    table = read_pairs(write_pairs(rows, tmp_path / "pairs.parquet"))
    assert table.column("clean_answer_ids").to_pylist()[2] == nigeria["clean_answer_ids"]
    pairs = accepted_pairs(table)
    assert pairs[2].clean_answer_ids == tuple(nigeria["clean_answer_ids"])


def test_single_policy_rejects_and_first_token_cuts(tmp_path, tok):
    records = [cf(i, s, a) for i, (s, a) in enumerate(MIXED)]
    single = rows_for(tmp_path, tok, records, answer_policy="single")
    assert [r["reason"] for r in single[2:]] == ["answer_multi_token"] * 2
    assert "'Abuja' is 2 tokens [' Abu', 'ja']" in single[2]["detail"]
    assert [r["status"] for r in single[:2]] == ["accepted"] * 2
    assert {r["answer_policy"] for r in single[:2]} == {"single"}
    cut = rows_for(tmp_path, tok, records, answer_policy="first-token")
    assert [r["status"] for r in cut] == ["accepted"] * 4
    nigeria = cut[2]
    assert nigeria["clean_answer_ids"] == [nigeria["clean_answer_id"]] == tok.encode(" Abu", add_special_tokens=False)
    assert nigeria["answer_policy"] == "first-token"
    with pytest.raises(ValueError, match="unknown answer policy 'whole'; use one of single, full, first-token"):
        rows_for(tmp_path, tok, records, answer_policy="whole")


def test_answer_rejections_name_what_is_wrong(tmp_path, tok):
    records = [
        _pair(id="empty", clean_answer="  "),
        # "The capital of France is " + "Paris": ' Paris' together, ' ' then 'Paris' apart
        _pair(id="space", clean_prompt="The capital of France is ", corrupt_prompt="The capital of Germany is ",
              clean_answer="Paris", corrupt_answer="Berlin"),
        _pair(id="long", clean_answer=" Abu Dhabi"),  # 5 prompt tokens + 4 answer tokens - 1 = 8
    ]
    by = {r["pair_id"]: r for r in rows_for(tmp_path, tok, records, "patchgrid", max_len=7)}
    assert by["empty"]["reason"] == "empty_answer" and "the clean answer '  ' is empty" in by["empty"]["detail"]
    assert by["space"]["reason"] == "answer_tokenization"
    assert by["space"]["detail"] == ("the clean answer 'Paris' tokenizes differently after the prompt than alone: "
                                     "prompt + answer as one text ends [' Paris'], the prompt's tokens then the "
                                     "answer's [' ', 'Paris']")
    assert by["long"]["reason"] == "answer_too_long"
    assert by["long"]["detail"] == ("the clean answer ' Abu Dhabi' is 4 tokens; after the 5-token prompt that is 8 "
                                    "tokens, more than the model's 7")
    # the tokenization is checked under every policy: a cut answer's first token must follow the prompt
    for policy in ("single", "first-token"):
        rows = rows_for(tmp_path, tok, records[1:2], "patchgrid", answer_policy=policy)
        assert rows[0]["reason"] == "answer_tokenization"
    # cut to one token, the answer fits
    rows = rows_for(tmp_path, tok, records[2:], "patchgrid", max_len=7, answer_policy="first-token")
    assert rows[0]["status"] == "accepted" and rows[0]["answer_policy"] == "first-token"


def test_fact_prompts_ending_in_a_space_are_rejected(tmp_path, tok):
    records = [cf(i, s, a, prompt="The capital of {} is ") for i, (s, a) in enumerate(CAPITALS[:2])]
    rows = rows_for(tmp_path, tok, records)
    assert [r["reason"] for r in rows] == ["answer_tokenization"] * 2
    assert not rows[0]["usable_alone"]


def test_first_token_policy_is_recorded(tmp_path, tok):
    records = [cf(0, "United Arab Emirates", "Abu Dhabi"), cf(1, "United Kingdom", "London")]
    rows = rows_for(tmp_path, tok, records, answer_policy="first-token")
    uae = rows[0]
    if uae["status"] == "accepted":
        assert uae["answer_policy"] == "first-token"
    else:  # subjects of different token counts cannot pair; the policy still let the answer through
        assert uae["reason"] == "no_partner"


def test_too_long_for_the_model(tmp_path, tok):
    rows = rows_for(tmp_path, tok, [cf(0, "France", "Paris"), cf(1, "Germany", "Berlin")], max_len=4)
    assert {r["reason"] for r in rows} == {"too_long"}


def _pair(**kw):
    base = {"clean_prompt": "The capital of France is", "corrupt_prompt": "The capital of Germany is",
            "clean_answer": " Paris", "corrupt_answer": " Berlin"}
    return dict(base, **kw)


def test_explicit_pairs(tmp_path, tok):
    records = [
        _pair(id="ok", subject="France", corrupt_subject="Germany", relation="capital"),
        _pair(id="nosubject"),
        _pair(id="length", corrupt_prompt="The capital of the United States is", corrupt_answer=" Washington"),
        _pair(id="outside", corrupt_prompt="The capital of Germany was", subject="France", corrupt_subject="Germany"),
        _pair(id="same", corrupt_answer=" Paris"),
        _pair(id="multi", clean_answer=" Paris, France"),
        _pair(id="same_multi", clean_answer=" Paris, France", corrupt_answer=" Paris, France"),
        _pair(id="identical", corrupt_prompt="The capital of France is"),
    ]
    rows = rows_for(tmp_path, tok, records, "patchgrid")
    by = {r["pair_id"]: r for r in rows}
    assert by["ok"]["status"] == "accepted" and (by["ok"]["subject_start"], by["ok"]["subject_end"]) == (3, 4)
    assert by["nosubject"]["status"] == "accepted" and by["nosubject"]["subject_start"] == 3
    assert not by["nosubject"]["usable_alone"]  # no subject named: cannot noise it alone
    assert by["length"]["reason"] == "length_mismatch"
    assert by["outside"]["reason"] == "differs_outside_subject"
    assert by["same"]["reason"] == "same_answer"
    assert by["multi"]["status"] == "accepted" and by["multi"]["answer_policy"] == "full"
    assert [tok.decode([t]) for t in by["multi"]["clean_answer_ids"]] == [" Paris", ",", " France"]
    assert by["same_multi"]["reason"] == "same_answer" and "the same 3 tokens" in by["same_multi"]["detail"]
    assert by["identical"]["reason"] == "identical_prompts"
    single = {r["pair_id"]: r for r in rows_for(tmp_path, tok, records, "patchgrid", answer_policy="single")}
    assert single["multi"]["reason"] == "answer_multi_token"


def test_table_round_trip_and_summary(tmp_path, tok):
    rows = rows_for(tmp_path, tok, [cf(0, "France", "Paris"), cf(1, "Germany", "Berlin"), cf(2, "", "x")])
    table = read_pairs(write_pairs(rows, tmp_path / "pairs.parquet"))
    assert table.num_rows == 3
    assert table.column("status").to_pylist() == ["accepted", "accepted", "rejected"]
    assert summary(rows) == {("accepted", None): 2, ("rejected", "empty_subject"): 1}
    # a missing output folder is made
    assert read_pairs(write_pairs(rows, tmp_path / "new" / "pairs.parquet")).num_rows == 3


@pytest.mark.parametrize("model,bos", [("tiny-gemma2", True), ("tiny-gptj", False)])
def test_a_familys_token_handling_lines_pairs_up(tmp_path, tokenizers, model, bos):
    """Gemma's tokenizer starts every text with <bos>, GPT-J's (GPT-2's BPE) adds nothing; answers
    carry their leading space either way and are checked to follow the prompt's own tokens."""
    tok = tokenizers(model)
    rows = rows_for(tmp_path, tok, [cf(i, s, a) for i, (s, a) in enumerate(CAPITALS[:4])])
    assert [r["status"] for r in rows] == ["accepted"] * 4
    for r in rows:
        ids = tok(r["clean_prompt"], add_special_tokens=False).input_ids
        assert r["clean_ids"] == ([tok.bos_token_id] if bos else []) + ids
        s, e = r["subject_start"], r["subject_end"]
        assert r["roles"][0] == "before_subject" and s == len(tok("The capital of").input_ids)
        assert tok.decode(r["clean_ids"][s:e]).strip() == r["subject"]
        assert all(a == b for p, (a, b) in enumerate(zip(r["clean_ids"], r["corrupt_ids"])) if not s <= p < e)
        assert r["clean_answer_ids"][:1] == tok(" " + r["clean_answer"], add_special_tokens=False).input_ids[:1]
