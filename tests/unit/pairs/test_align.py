"""patchgrid.pairs.align on a word tokenizer whose tokens are known by hand: the subject's tokens,
the roles of positions, the answers' tokens and the position-by-position check of a pair."""
from __future__ import annotations

import re

import pytest

from patchgrid.pairs.align import (
    Answer,
    Prompt,
    Rejection,
    align,
    answer_ids,
    answer_text,
    check_fits,
    pair_policy,
    position_roles,
    tokenize_with_subject,
)

PROMPT = "The capital of France is"  # The | capital | of | France | is


class Words:
    """One token per word with its leading space; trailing white space is a token of its own."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def _pieces(self, text):
        return [(m.group(), m.start(), m.end()) for m in re.finditer(r"\s?\S+|\s+", text)]

    def _id(self, piece):
        return self.vocab.setdefault(piece, len(self.vocab))

    def __call__(self, text, return_offsets_mapping=False):
        pieces = self._pieces(text)
        out = {"input_ids": [self._id(p) for p, _, _ in pieces]}
        if return_offsets_mapping:
            out["offset_mapping"] = [(a, b) for _, a, b in pieces]
        return out

    def encode(self, text, add_special_tokens=False):
        return self(text)["input_ids"]

    def decode(self, ids):
        words = {i: w for w, i in self.vocab.items()}
        return "".join(words[i] for i in ids)


@pytest.fixture
def tok():
    return Words()


def test_the_subject_is_the_tokens_that_cover_its_characters(tok):
    p = tokenize_with_subject(tok, PROMPT, "France")
    assert len(p.ids) == 5 and p.span == (3, 4)
    assert tokenize_with_subject(tok, "The mayor of New York is", "New York").span == (3, 5)
    # a subject that is part of a word covers the whole word's token
    assert tokenize_with_subject(tok, "The capital of Francia is", "Franc").span == (3, 4)
    # where the subject occurs twice, char_start says which
    twice = "Paris is in France, not France"
    assert tokenize_with_subject(tok, twice, "France").span == (3, 4)
    assert tokenize_with_subject(tok, twice, "France", char_start=twice.rindex("France")).span == (5, 6)
    assert tokenize_with_subject(tok, PROMPT, None) == Prompt(p.ids, (0, 0))


@pytest.mark.parametrize("subject, message", [("Spain", "subject 'Spain' does not occur in 'The capital of France is'"),
                                              ("", "subject '' does not occur")])
def test_a_subject_not_in_the_prompt_is_rejected(tok, subject, message):
    with pytest.raises(Rejection, match=message) as err:
        tokenize_with_subject(tok, PROMPT, subject)
    assert err.value.code == "subject_not_found"


def test_positions_are_named_by_their_place_around_the_subject():
    assert position_roles(6, 1, 3) == ["before_subject", "subject_first", "subject_last", "after_subject", "further",
                                       "last"]
    assert position_roles(4, 1, 2) == ["before_subject", "subject_last", "after_subject", "last"]  # one-token subject
    assert position_roles(5, 1, 4) == ["before_subject", "subject_first", "subject_middle", "subject_last", "last"]
    # the last position is the last, even when the subject ends there
    assert position_roles(3, 1, 3) == ["before_subject", "subject_first", "last"]


def _prompt(ids, span=(1, 2)):
    return Prompt(tuple(ids), span)


def test_a_pair_differing_only_inside_the_subject_aligns():
    assert align(_prompt([5, 6, 7, 8]), _prompt([5, 9, 7, 8])) is None
    assert align(_prompt([5, 6, 7, 8], (1, 3)), _prompt([5, 9, 10, 8], (1, 3))) is None
    assert align(_prompt([5, 6, 7, 8]), _prompt([5, 6, 7, 8])) is None
    # a corrupt prompt without a subject of its own is read at the clean prompt's subject
    assert align(_prompt([5, 6, 7, 8]), _prompt([5, 9, 7, 8], (0, 0))) is None


@pytest.mark.parametrize("clean, corrupt, code, message", [
    (_prompt([5, 6, 7, 8]), _prompt([5, 6, 7]), "length_mismatch", "clean is 4 tokens, corrupt 3"),
    (_prompt([5, 6, 7, 8], (1, 2)), _prompt([5, 6, 7, 8], (1, 3)), "differs_outside_subject",
     "the subject spans tokens (1, 2) in clean but (1, 3) in corrupt"),
    (_prompt([5, 6, 7, 8]), _prompt([4, 9, 7, 3]), "differs_outside_subject",
     "clean and corrupt differ outside the subject at positions [0, 3]"),
    (_prompt([5, 6, 7, 8]), _prompt([5, 6, 1, 8], (0, 0)), "differs_outside_subject",
     "clean and corrupt differ outside the subject at positions [2]"),
])
def test_a_pair_that_does_not_line_up_is_rejected_with_where(clean, corrupt, code, message):
    with pytest.raises(Rejection) as err:
        align(clean, corrupt)
    assert err.value.code == code and err.value.detail == message and str(err.value) == message


def test_an_answer_gets_the_space_the_next_token_carries():
    assert answer_text(PROMPT, "Paris") == " Paris"
    assert answer_text(PROMPT, " Paris") == " Paris"
    assert answer_text(PROMPT + " ", "Paris") == "Paris"


def test_answers_are_scored_by_the_tokens_asked_for(tok):
    ids = tuple(tok(PROMPT)["input_ids"])
    one = answer_ids(tok, PROMPT, ids, "Paris", "single", "clean", max_len=64)
    assert one == Answer(" Paris", (tok.vocab[" Paris"],), (tok.vocab[" Paris"],), "single")
    york = tuple(tok.encode(" New York"))
    assert answer_ids(tok, PROMPT, ids, "New York", "full", "clean", max_len=64) == Answer(" New York", york, york,
                                                                                            "full")
    assert answer_ids(tok, PROMPT, ids, "New York", "first-token", "clean", 64) == Answer(" New York", york, york[:1],
                                                                                           "first-token")
    # one-token answers are single whatever the policy
    assert answer_ids(tok, PROMPT, ids, "Paris", "full", "clean", 64).policy == "single"


@pytest.mark.parametrize("answer, policy, max_len, code, message", [
    ("New York", "single", 64, "answer_multi_token",
     "the corrupt answer 'New York' is 2 tokens [' New', ' York'] (--answer-policy single)"),
    ("  ", "full", 64, "empty_answer", "the corrupt answer '  ' is empty"),
    # 5 prompt tokens, then every answer token but the last: 6
    ("New York", "full", 5, "answer_too_long",
     "the corrupt answer 'New York' is 2 tokens; after the 5-token prompt that is 6 tokens, more than the model's 5"),
])
def test_answers_that_cannot_be_scored_are_rejected(tok, answer, policy, max_len, code, message):
    ids = tuple(tok(PROMPT)["input_ids"])
    with pytest.raises(Rejection) as err:
        answer_ids(tok, PROMPT, ids, answer, policy, "corrupt", max_len)
    assert err.value.code == code and err.value.detail == message


def test_an_answer_cut_to_its_first_token_is_not_held_to_the_length_limit(tok):
    ids = tuple(tok(PROMPT)["input_ids"])
    assert answer_ids(tok, PROMPT, ids, "New York", "first-token", "clean", max_len=5).policy == "first-token"


def test_an_answer_that_tokenizes_otherwise_after_the_prompt_is_rejected(tok):
    prompt = PROMPT + " "  # the prompt's last token is the space, which " Paris" would carry
    ids = tuple(tok(prompt)["input_ids"])
    with pytest.raises(Rejection) as err:
        answer_ids(tok, prompt, ids, "Paris", "full", "clean", 64)
    assert err.value.code == "answer_tokenization"
    assert err.value.detail == ("the clean answer 'Paris' tokenizes differently after the prompt than alone: "
                                "prompt + answer as one text ends [' Paris'], the prompt's tokens then the "
                                "answer's [' ', 'Paris']")


def test_a_pair_records_the_policy_of_its_most_cut_answer():
    single, full, cut = (Answer("a", (1,), (1,), "single"), Answer("b", (1, 2), (1, 2), "full"),
                         Answer("c", (1, 2), (1,), "first-token"))
    assert pair_policy(single, single) == "single"
    assert pair_policy(single, full) == "full"
    assert pair_policy(full, cut) == pair_policy(cut, single) == "first-token"


def test_a_prompt_longer_than_the_model_takes_is_rejected():
    check_fits(5, 5, "clean")
    with pytest.raises(Rejection, match="the corrupt prompt is 6 tokens; the model takes 5") as err:
        check_fits(6, 5, "corrupt")
    assert err.value.code == "too_long"
