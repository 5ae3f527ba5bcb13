"""Token-level checks: do a clean and a corrupt prompt line up position by position?"""
from __future__ import annotations

from dataclasses import dataclass


class Rejection(Exception):
    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    span: tuple[int, int]  # subject tokens [start, end)


def position_roles(n: int, start: int, end: int) -> list[str]:
    roles = []
    for p in range(n):
        if p == n - 1:
            roles.append("last")
        elif p < start:
            roles.append("before_subject")
        elif p == end - 1:
            roles.append("subject_last")  # a one-token subject is its own last token
        elif p == start:
            roles.append("subject_first")
        elif p < end:
            roles.append("subject_middle")
        elif p == end:
            roles.append("after_subject")
        else:
            roles.append("further")
    return roles


def tokenize_with_subject(tokenizer, prompt: str, subject: str | None, char_start: int | None = None) -> Prompt:
    enc = tokenizer(prompt, return_offsets_mapping=True)
    ids = tuple(enc["input_ids"])
    if subject is None:
        return Prompt(ids, (0, 0))
    start = prompt.find(subject) if char_start is None else char_start
    if start < 0 or not subject:
        raise Rejection("subject_not_found", f"subject {subject!r} does not occur in {prompt!r}")
    end = start + len(subject)
    toks = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end and b > start]
    if not toks:
        raise Rejection("subject_not_found", f"no token of {prompt!r} covers the subject {subject!r}")
    return Prompt(ids, (toks[0], toks[-1] + 1))


def answer_text(prompt: str, answer: str) -> str:
    """Answers in CounterFact and known_1000 carry no leading space; the next token does."""
    if answer[:1].isspace() or prompt[-1:].isspace():
        return answer
    return " " + answer


def answer_tokens(tokenizer, prompt: str, answer: str) -> tuple[str, tuple[int, ...]]:
    """The one rule an answer is tokenised by, a data set's or one typed at the command line: the text
    that follows the prompt (answer_text: a space before it when the prompt does not end in one) and
    its tokens; no tokens for an empty answer."""
    text = answer_text(prompt, answer)
    return text, (tuple(tokenizer.encode(text, add_special_tokens=False)) if answer.strip() else ())


@dataclass(frozen=True)
class Answer:
    text: str  # as it follows the prompt (with its leading space)
    whole: tuple[int, ...]  # every token of the answer
    ids: tuple[int, ...]  # the tokens scored after the prompt: `whole`, or its first under first-token
    policy: str  # single: one token; full: several, scored whole; first-token: several, cut to the first


def answer_ids(tokenizer, prompt: str, prompt_ids: tuple[int, ...], answer: str, policy: str, which: str,
               max_len: int) -> Answer:
    """The tokens an answer is scored by after `prompt` (whose tokens are `prompt_ids`) under the
    policy asked for (`full`, `single` or `first-token`)."""
    text, ids = answer_tokens(tokenizer, prompt, answer)
    if not ids:
        raise Rejection("empty_answer", f"the {which} answer {answer!r} is empty")
    if len(ids) > 1 and policy == "single":
        raise Rejection("answer_multi_token", f"the {which} answer {answer!r} is {len(ids)} tokens "
                                              f"{_shown(tokenizer, ids)} (--answer-policy single)")
    ans = Answer(text, ids, ids, "full" if len(ids) > 1 else "single")
    check_follows(tokenizer, prompt, prompt_ids, ans, which)
    if len(ids) > 1 and policy == "first-token":
        return Answer(text, ids, ids[:1], "first-token")
    # teacher-forced: the prompt and every answer token but the last go through the model
    if len(prompt_ids) + len(ids) - 1 > max_len:
        raise Rejection("answer_too_long",
                        f"the {which} answer {answer!r} is {len(ids)} tokens; after the {len(prompt_ids)}-token "
                        f"prompt that is {len(prompt_ids) + len(ids) - 1} tokens, more than the model's {max_len}")
    return ans


def check_follows(tokenizer, prompt: str, prompt_ids: tuple[int, ...], answer: Answer, which: str) -> None:
    """The answer's tokens are what follows the prompt's tokens when both are tokenized as one text.

    Otherwise (a prompt ending in a space, an answer whose first characters merge with the prompt's
    last token) the ids scored are not the answer as the model would read it. A cut answer is
    checked whole: its first token must be the one that follows the prompt."""
    joint = tuple(tokenizer(prompt + answer.text)["input_ids"])
    apart = tuple(prompt_ids) + answer.whole
    if joint == apart:
        return
    d = next((k for k, (a, b) in enumerate(zip(joint, apart)) if a != b), min(len(joint), len(apart)))
    d = min(d, len(prompt_ids))
    raise Rejection("answer_tokenization",
                    f"the {which} answer {answer.text!r} tokenizes differently after the prompt than alone: "
                    f"prompt + answer as one text ends {_shown(tokenizer, joint[d:])}, the prompt's tokens "
                    f"then the answer's {_shown(tokenizer, apart[d:])}")


def pair_policy(*answers: Answer) -> str:
    """The policy recorded for a pair: first-token if an answer was cut, full if one is scored
    whole over several tokens, else single."""
    policies = {a.policy for a in answers}
    return next(p for p in ("first-token", "full", "single") if p in policies)


def _shown(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def check_fits(n: int, max_len: int, which: str):
    if n > max_len:
        raise Rejection("too_long", f"the {which} prompt is {n} tokens; the model takes {max_len}")


def align(clean: Prompt, corrupt: Prompt) -> None:
    """Same length, and differing only inside the subject's tokens."""
    if len(clean.ids) != len(corrupt.ids):
        raise Rejection("length_mismatch", f"clean is {len(clean.ids)} tokens, corrupt {len(corrupt.ids)}")
    if clean.span != corrupt.span and corrupt.span != (0, 0):
        raise Rejection("differs_outside_subject",
                        f"the subject spans tokens {clean.span} in clean but {corrupt.span} in corrupt")
    start, end = clean.span
    outside = [p for p, (a, b) in enumerate(zip(clean.ids, corrupt.ids)) if a != b and not start <= p < end]
    if outside:
        raise Rejection("differs_outside_subject",
                        f"clean and corrupt differ outside the subject at positions {outside}")
