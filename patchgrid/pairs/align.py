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


@dataclass(frozen=True)
class Aligned:
    clean: Prompt
    corrupt: Prompt
    clean_answer_id: int
    corrupt_answer_id: int
    answer_policy: str  # "single", or "first-token" when an answer was cut to its first token

    @property
    def roles(self) -> list[str]:
        return position_roles(len(self.clean.ids), *self.clean.span)


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


def answer_id(tokenizer, prompt: str, answer: str, policy: str, which: str) -> tuple[int, bool]:
    ids = tokenizer.encode(answer_text(prompt, answer), add_special_tokens=False)
    if not ids:
        raise Rejection("empty_answer", f"the {which} answer is empty")
    if len(ids) > 1 and policy != "first-token":
        raise Rejection("answer_multi_token", f"the {which} answer {answer!r} is {len(ids)} tokens")
    return ids[0], len(ids) > 1


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
        raise Rejection("differs_outside_subject", f"clean and corrupt differ outside the subject at positions {outside}")
