"""The example everyone starts from, on the real pretrained model (smollm2-135m, bf16)."""
from __future__ import annotations

import pytest

from patchgrid.pipeline.one_pair import PairError, tokenize_pair

CLEAN, CORRUPT = "The capital of France is", "The capital of Germany is"


def test_pair_checks(tokenizers):
    tok = tokenizers("tiny-llama")
    with pytest.raises(PairError, match="different lengths"):
        tokenize_pair(tok, CLEAN, "The capital of the United Kingdom is", " Paris", " London")
    with pytest.raises(PairError, match="--corrupt-answer ' ' is empty"):
        tokenize_pair(tok, CLEAN, CORRUPT, " Paris", " ")
    with pytest.raises(PairError, match=r"--clean-answer ' Abuja' and --corrupt-answer ' Abuja' are the same tokens "
                                        r"\[' A', 'b', 'u', 'j', 'a'\]"):
        tokenize_pair(tok, CLEAN, CORRUPT, " Abuja", " Abuja")


def test_multi_token_answers_are_kept_whole(tokenizers):
    from patchgrid.pipeline.one_pair import as_pair

    tok = tokenizers("tiny-llama")
    tokens = tokenize_pair(tok, CLEAN, CORRUPT, " Paris", " Londonderry")
    longer = tuple(tok.encode(" Londonderry", add_special_tokens=False))
    assert len(longer) > 1 and tokens.corrupt_answer_ids == longer and tokens.corrupt_answer == longer[0]
    pair = as_pair(tokens)
    assert pair.continuations == ((tokens.clean_answer,), longer)
    assert pair.answers == (tokens.clean_answer, longer[0])

