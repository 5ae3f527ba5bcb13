"""Whether the model knows a fact: the log-probabilities of answers after prompts, scored in batched
engine calls, and the require-known rule decided on them."""
from __future__ import annotations

import math
from collections import defaultdict

from ..plan import Request


class Scorer:
    """log p(answer | prompt), summed over the answer's tokens, asked for in batched engine calls and
    kept; with the logits of the answers' first tokens and each prompt's top token."""

    def __init__(self, engine):
        self.engine = engine
        self.logprob: dict[tuple, float] = {}  # (prompt ids, answer ids) -> log-probability
        self.logit: dict[tuple, float] = {}  # (prompt ids, first answer token) -> logit at the last position
        self.top: dict[tuple, int] = {}  # prompt ids -> top token at the last position

    def ask(self, wanted) -> None:
        """One engine call scoring every (prompt ids, answer ids) in `wanted` not scored yet."""
        by_prompt: dict[tuple, set] = defaultdict(set)
        for prompt, answer in wanted:
            if (prompt, answer) not in self.logprob:
                by_prompt[prompt].add(answer)
        if not by_prompt:
            return
        order, reqs = [], []
        for prompt, answers in by_prompt.items():
            answers = tuple(sorted(answers))
            firsts = tuple(sorted({x[0] for x in answers}))
            order.append((prompt, answers, firsts))
            reqs.append(Request(tokens=prompt, answers=firsts, continuations=answers, top_k=1))
        for (prompt, answers, firsts), res in zip(order, self.engine.run(reqs)):
            self.logprob.update({(prompt, x): math.fsum(lp) for x, lp in zip(answers, res.continuation_logprobs)})
            self.logit.update({(prompt, t): float(v) for t, v in zip(firsts, res.answer_logits)})
            self.top[prompt] = res.top_ids[0]

    def judge(self, clean: tuple, corrupt: tuple, a: tuple, b: tuple) -> dict | None:
        """A pair's known-check numbers (clean prompt and answer, corrupt prompt and answer), or None
        while one is not scored yet: the log-probability differences, on which the check is decided
        (for one-token answers they equal the logit differences: both share the last position's
        normaliser), and the logit differences when both answers are one token (a longer answer's
        first token does not decide it)."""
        keys = [(clean, a), (clean, b), (corrupt, a), (corrupt, b)]
        if any(k not in self.logprob for k in keys):
            return None
        lp = [self.logprob[k] for k in keys]
        one = len(a) == 1 and len(b) == 1
        return dict(clean_logprob_diff=lp[0] - lp[1], corrupt_logprob_diff=lp[2] - lp[3],
                    clean_logit_diff=self.logit[clean, a[0]] - self.logit[clean, b[0]] if one else None,
                    corrupt_logit_diff=self.logit[corrupt, a[0]] - self.logit[corrupt, b[0]] if one else None)

    @staticmethod
    def needs(clean: tuple, corrupt: tuple, a: tuple, b: tuple) -> set:
        return {(clean, a), (clean, b), (corrupt, a), (corrupt, b)}


def unknown_side(judged: dict) -> tuple[str, str] | None:
    """The require-known rule, on a pair's `Scorer.judge` numbers: the model knows the pair when it
    prefers the clean answer after the clean prompt (log-probability difference > 0) and the
    corrupt answer after the corrupt prompt (< 0). None when it does; else the (reason, detail) of
    the first side it fails on, not_known_clean or not_known_corrupt."""
    cl, co = judged["clean_logprob_diff"], judged["corrupt_logprob_diff"]
    if cl <= 0:
        return "not_known_clean", f"clean log-probability difference {cl:+.3f} is not positive"
    if co >= 0:
        return "not_known_corrupt", f"corrupt log-probability difference {co:+.3f} is not negative"
    return None
