"""The backend tests' comparison of two runs' answer ranks (tests/support/backends.py): a rank two
correct float32 runs may order either way (another token's logit within the tolerance of the
answer's) passes; any other difference fails."""
from __future__ import annotations

import pytest
import torch

from patchgrid.metrics import answer_ranks
from patchgrid.plan import Result
from tests.support.backends import assert_results_close


def _result(logits: list[float], answer: int, with_logprobs: bool = True) -> Result:
    lg = torch.tensor(logits, dtype=torch.float32)
    lse = float(torch.logsumexp(lg, -1))
    return Result(answer_logits=lg[[answer]], logsumexp=lse, top_ids=[], top_logits=[],
                  answer_ranks=answer_ranks(lg, [answer]).tolist(),
                  logprobs=torch.log_softmax(lg, -1) if with_logprobs else None)


def test_a_near_tie_may_order_either_way():
    a = _result([0.5, 0.10000, 0.100003, -1.0], answer=1)  # rank 2: token 2 is above by 3e-6
    b = _result([0.5, 0.10000, 0.099998, -1.0], answer=1)  # rank 1
    assert a.answer_ranks != b.answer_ranks
    assert_results_close([a], [b])
    assert_results_close([b], [a])


def test_a_rank_off_by_more_than_a_tie_fails():
    a = _result([0.5, 0.1, 0.3, -1.0], answer=1)   # rank 2
    b = _result([0.5, 0.1, 0.3, -1.0], answer=1)
    wrong = Result(**{**a.__dict__, "answer_ranks": [1]})
    with pytest.raises(AssertionError, match="answer ranks differ"):
        assert_results_close([wrong], [b])


def test_without_log_probabilities_ranks_must_be_equal():
    a = _result([0.5, 0.10000, 0.100003, -1.0], answer=1, with_logprobs=False)
    b = _result([0.5, 0.10000, 0.099998, -1.0], answer=1, with_logprobs=False)
    with pytest.raises(AssertionError, match="answer ranks differ"):
        assert_results_close([a], [b])
