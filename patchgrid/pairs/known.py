"""Whether the model knows a fact: the log-probabilities of answers after prompts, scored in batched
engine calls, and the rules decided on them: require-known (pairs) and the trace-facts rules (which
facts causal tracing runs on)."""
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


# Which facts causal tracing runs on (--trace-facts), both decided on the model's top-1 next token
# after the clean prompt:
#   first-token  the answer's first token is it (known_alone); the fact is scored by p of the whole answer
#   rome         ROME's rule (experiments/causal_trace.py, calculate_hidden_flow): it is the whole answer,
#                so answers of several tokens are left out; p of the answer is then p of that token
TRACE_FACTS = ("first-token", "rome")


def trace_rejection(rule: str, row: dict) -> tuple[str, str] | None:
    """Why causal tracing under `rule` leaves out the fact of a pairs-table row that stands alone
    (`usable_alone`): None when it traces it; else (reason, detail): not_known_alone (the top-1
    next token is not the answer's first token) or, under rome, not_whole_answer (the answer is
    several tokens, or was cut to its first by --answer-policy first-token)."""
    if rule not in TRACE_FACTS:
        raise ValueError(f"unknown trace-facts rule {rule!r}; use one of {', '.join(TRACE_FACTS)}")
    if not row["known_alone"]:
        return "not_known_alone", "the model's top-1 next token after the clean prompt is not the answer's first token"
    n = len(row["clean_answer_ids"] or ())
    if rule == "rome" and n > 1:
        return "not_whole_answer", (f"the answer is {n} tokens: ROME's rule traces a fact only when the model's "
                                    "top-1 next token is the whole answer")
    if rule == "rome" and row["answer_policy"] == "first-token":
        return "not_whole_answer", ("an answer of this record was cut to its first token (--answer-policy "
                                    "first-token): ROME's rule traces a fact only when the model's top-1 next "
                                    "token is the whole answer")
    return None
