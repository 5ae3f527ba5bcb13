"""Records -> clean/corrupt pairs, one output row per input record, accepted or rejected with a reason.

Facts are paired by subject swap: fact A's prompt is clean, the same template with the subject of
another fact B of the same relation is corrupt; B's subject has as many tokens as A's and its
answer differs. The partner is drawn by a generator seeded per fact, so a rerun gives the same
pairs. Explicit pairs (patchgrid's own format) are checked as they are.
"""
from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass
from itertools import islice

from ..plan import Request
from ..rows import ANSWER_POLICIES
from .align import (
    Answer,
    Prompt,
    Rejection,
    align,
    answer_ids,
    check_fits,
    check_follows,
    pair_policy,
    position_roles,
    tokenize_with_subject,
)
from .sources import Record, read_source


@dataclass
class _Fact:
    rec: Record
    prompt: Prompt
    answer: Answer

    @property
    def answer_ids(self) -> tuple[int, ...]:
        return self.answer.ids


def build_pairs(records: list[Record], tokenizer, *, max_len: int, seed: int = 0, answer_policy: str = "full",
                engine=None, require_known: bool = False) -> list[dict]:
    check_answer_policy(answer_policy)
    if require_known and engine is None:
        raise ValueError("require_known needs an engine")
    rows: list[dict | None] = [None] * len(records)
    facts: dict[int, _Fact] = {}
    pairs: list[int] = []
    for i, rec in enumerate(records):
        if rec.problem is not None:
            rows[i] = _row(rec, reason=rec.problem)
        elif rec.is_pair:
            pairs.append(i)
        else:
            try:
                facts[i] = _fact(tokenizer, rec, answer_policy, max_len)
            except Rejection as r:
                rows[i] = _row(rec, reason=(r.code, r.detail), usable_alone=False)
    # with an engine, every fact is asked whether the model knows it alone (causal tracing's
    # facts); pairs are filtered by what the model knows only with require_known
    _pair_facts(facts, rows, tokenizer, seed, engine, require_known)
    _check_explicit(records, pairs, rows, tokenizer, answer_policy, max_len, engine, require_known)
    return rows


def check_answer_policy(policy: str) -> None:
    # all three recorded policies can also be asked for: "full" scores multi-token answers whole,
    # "single" rejects them, "first-token" cuts them
    if policy not in ANSWER_POLICIES:
        raise ValueError(f"unknown answer policy {policy!r}; use one of {', '.join(ANSWER_POLICIES)}")


def summary(rows: list[dict]) -> dict[tuple[str, str | None], int]:
    counts: dict[tuple[str, str | None], int] = defaultdict(int)
    for r in rows:
        counts[(r["status"], r["reason"])] += 1
    return dict(sorted(counts.items(), key=lambda kv: (kv[0][0], -kv[1], kv[0][1] or "")))


# ---- facts ----

def _fact(tok, rec: Record, policy: str, max_len: int) -> _Fact:
    start = rec.template.index("{}")
    prompt = tokenize_with_subject(tok, rec.prompt, rec.subject, start)
    check_fits(len(prompt.ids), max_len, "clean")
    return _Fact(rec, prompt, answer_ids(tok, rec.prompt, prompt.ids, rec.answer, policy, "clean", max_len))


def _pair_facts(facts: dict[int, _Fact], rows, tok, seed: int, engine, require_known: bool) -> None:
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, f in facts.items():
        groups[(f.rec.relation, f.rec.template)].append(i)
    walks = {}
    for i, a in facts.items():
        span = a.prompt.span[1] - a.prompt.span[0]
        cands = [j for j in groups[(a.rec.relation, a.rec.template)]
                 if j != i and facts[j].answer_ids != a.answer_ids
                 and facts[j].prompt.span[1] - facts[j].prompt.span[0] == span]
        random.Random(f"{seed}:{a.rec.record_id}").shuffle(cands)
        walks[i] = _Walk(facts, i, cands, tok)
    scorer = _Scorer(engine) if engine is not None and facts else None
    need: set = set()
    if scorer is not None:
        # every fact's own answer and top token (known_alone), whether it pairs or not; and every
        # one-token answer it may be paired with: read at the last prompt position of the forward
        # the prompt takes anyway, they cost nothing
        need = {(f.prompt.ids, f.answer_ids) for f in facts.values()}
        need |= {(facts[i].prompt.ids, facts[j].answer_ids) for i, w in walks.items() for j in w.cands
                 if len(facts[j].answer_ids) == 1}
    # Partners are tried in their drawn order; the scores a fact's next candidates need are asked
    # for in rounds, one engine call each, twice as many candidates per fact each round. Scoring
    # every candidate up front costs a forward per multi-token answer per prompt (minutes on the
    # shipped facts); most facts take their first candidate.
    undecided = list(walks.values())
    while undecided:
        for w in undecided:
            w.step(scorer, require_known, need)
        undecided = [w for w in undecided if not w.done]
        if not need:
            break
        scorer.ask(need)
        need = set()
    for i, w in walks.items():
        a = facts[i]
        known_alone = None if scorer is None else scorer.top[a.prompt.ids] == a.answer_ids[0]
        common = dict(usable_alone=True, known_alone=known_alone, clean_answer=a.answer)
        if w.chosen is None:
            rows[i] = _row(a.rec, reason=w.reason(), clean=a.prompt, **common)
            continue
        b, judged = w.chosen
        rows[i] = _row(a.rec, clean=a.prompt, corrupt=b.prompt, corrupt_prompt=b.rec.prompt,
                       corrupt_subject=b.rec.subject, corrupt_answer_text=b.rec.answer, corrupt_answer=b.answer,
                       judged=judged, **common)


class _Scorer:
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


class _Walk:
    """One fact's search for a partner through its candidates, in their drawn order: the first that
    lines up (and, with require_known, that the model knows both ways) is its corrupt side."""

    def __init__(self, facts: dict[int, _Fact], i: int, cands: list[int], tok):
        self.facts, self.a, self.cands, self.tok = facts, facts[i], cands, tok
        self.pos = 0
        self.ahead = 1  # candidates to ask scores for when the next one is not scored yet
        self.lined_up = self.clean_known = 0
        self.chosen: tuple[_Fact, dict | None] | None = None
        self.done = False
        self._fits: dict[int, bool] = {}

    def fits(self, j: int) -> bool:
        """The prompts line up, and each answer's tokens are what follows the other's prompt too (both
        answers are scored after both prompts)."""
        if j not in self._fits:
            a, b = self.a, self.facts[j]
            try:
                align(a.prompt, b.prompt)
                check_follows(self.tok, a.rec.prompt, a.prompt.ids, b.answer, "corrupt")
                check_follows(self.tok, b.rec.prompt, b.prompt.ids, a.answer, "clean")
                self._fits[j] = True
            except Rejection:
                self._fits[j] = False
        return self._fits[j]

    def step(self, scorer: _Scorer | None, require_known: bool, need: set) -> None:
        """Go on through the candidates until decided, or until a score is missing: then add the
        scores of the next `ahead` fitting candidates to `need` and wait for them."""
        a = self.a
        while self.pos < len(self.cands):
            j = self.cands[self.pos]
            if not self.fits(j):
                self.pos += 1
                continue
            b = self.facts[j]
            judged = None
            if scorer is not None:
                judged = scorer.judge(a.prompt.ids, b.prompt.ids, a.answer_ids, b.answer_ids)
                if judged is None:
                    # without require_known the first fitting candidate is taken: no need to look ahead
                    fitting = (k for k in self.cands[self.pos:] if self.fits(k))
                    ahead = islice(fitting, self.ahead if require_known else 1)
                    for k in ahead:
                        need |= scorer.needs(a.prompt.ids, self.facts[k].prompt.ids, a.answer_ids,
                                             self.facts[k].answer_ids)
                    self.ahead *= 2
                    return
            self.lined_up += 1
            self.pos += 1
            if require_known:
                if judged["clean_logprob_diff"] <= 0:
                    continue
                self.clean_known += 1
                if judged["corrupt_logprob_diff"] >= 0:
                    continue
            self.chosen = (b, judged)
            break
        self.done = True

    def reason(self) -> tuple[str, str]:
        a = self.a
        if not self.lined_up:
            span = a.prompt.span[1] - a.prompt.span[0]
            return ("no_partner", f"no other fact of relation {a.rec.relation!r} with this template, a {span}-token "
                                  "subject and a different answer lines up with it (the prompts token by token, "
                                  "each answer's tokens after the other's prompt)")
        if not self.clean_known:
            return ("not_known_clean", f"the model does not prefer {a.rec.answer!r} over any partner's answer")
        return ("not_known_corrupt", "no partner's corrupt prompt makes the model prefer its own answer")


# ---- explicit pairs ----

def _check_explicit(records, idx, rows, tok, policy, max_len, engine, require_known: bool) -> None:
    ok = []
    for i in idx:
        rec = records[i]
        try:
            clean = tokenize_with_subject(tok, rec.clean_prompt, rec.subject)
            corrupt = tokenize_with_subject(tok, rec.corrupt_prompt, rec.corrupt_subject)
            if len(clean.ids) != len(corrupt.ids):
                align(clean, corrupt)  # raises length_mismatch
            if rec.subject is None:
                diff = [p for p, (a, b) in enumerate(zip(clean.ids, corrupt.ids)) if a != b]
                if not diff:
                    raise Rejection("identical_prompts", "clean and corrupt tokenize to the same tokens")
                clean = Prompt(clean.ids, (diff[0], diff[-1] + 1))
            if rec.corrupt_subject is None:
                corrupt = Prompt(corrupt.ids, clean.span)
            align(clean, corrupt)
            check_fits(len(clean.ids), max_len, "clean")
            a = answer_ids(tok, rec.clean_prompt, clean.ids, rec.clean_answer, policy, "clean", max_len)
            b = answer_ids(tok, rec.corrupt_prompt, corrupt.ids, rec.corrupt_answer, policy, "corrupt", max_len)
            # both answers are scored after both prompts
            check_follows(tok, rec.corrupt_prompt, corrupt.ids, a, "clean")
            check_follows(tok, rec.clean_prompt, clean.ids, b, "corrupt")
            if a.ids == b.ids:
                what = "token" if len(a.ids) == 1 else f"{len(a.ids)} tokens"
                raise Rejection("same_answer", f"clean and corrupt answers are the same {what} "
                                               f"({rec.clean_answer!r}, {rec.corrupt_answer!r})")
        except Rejection as r:
            rows[i] = _row(rec, reason=(r.code, r.detail))
            continue
        rows[i] = _row(rec, clean=clean, corrupt=corrupt, corrupt_prompt=rec.corrupt_prompt,
                       corrupt_subject=rec.corrupt_subject, corrupt_answer_text=rec.corrupt_answer, clean_answer=a,
                       corrupt_answer=b, usable_alone=rec.subject is not None)
        ok.append((i, a, b))
    if engine is None or not ok:
        return
    scorer = _Scorer(engine)
    wanted: set = set()
    for i, a, b in ok:
        wanted |= scorer.needs(tuple(rows[i]["clean_ids"]), tuple(rows[i]["corrupt_ids"]), a.ids, b.ids)
    scorer.ask(wanted)
    for i, a, b in ok:
        row = rows[i]
        clean = tuple(row["clean_ids"])
        judged = scorer.judge(clean, tuple(row["corrupt_ids"]), a.ids, b.ids)
        row.update(judged, known_alone=scorer.top[clean] == a.ids[0])
        if not require_known:
            continue
        cl, co = judged["clean_logprob_diff"], judged["corrupt_logprob_diff"]
        if cl <= 0:
            row.update(status="rejected", reason="not_known_clean",
                       detail=f"clean log-probability difference {cl:+.3f} is not positive")
        elif co >= 0:
            row.update(status="rejected", reason="not_known_corrupt",
                       detail=f"corrupt log-probability difference {co:+.3f} is not negative")


# ---- rows ----

def _row(rec: Record, *, reason=None, clean: Prompt | None = None, corrupt: Prompt | None = None,
         corrupt_prompt=None, corrupt_subject=None, corrupt_answer_text=None, clean_answer: Answer | None = None,
         corrupt_answer: Answer | None = None, judged: dict | None = None, usable_alone=False,
         known_alone=None) -> dict:
    span = clean.span if clean is not None else (None, None)
    has_span = clean is not None and span[1] > span[0]
    scored = [x for x in (clean_answer, corrupt_answer) if x is not None]
    judged = judged or {}
    return {
        "pair_id": rec.record_id,
        "source_line": rec.line,
        "relation": rec.relation,
        "status": "rejected" if reason else "accepted",
        "reason": reason[0] if reason else None,
        "detail": reason[1] if reason else None,
        "subject": rec.subject,
        "corrupt_subject": corrupt_subject,
        "clean_prompt": rec.prompt,
        "corrupt_prompt": corrupt_prompt if corrupt is not None else (rec.corrupt_prompt if rec.is_pair else None),
        "clean_answer": rec.clean_answer if rec.is_pair else rec.answer,
        "corrupt_answer": corrupt_answer_text if corrupt is not None else (rec.corrupt_answer if rec.is_pair else None),
        "clean_ids": list(clean.ids) if clean is not None else None,
        "corrupt_ids": list(corrupt.ids) if corrupt is not None else None,
        "clean_answer_id": clean_answer.ids[0] if clean_answer else None,
        "corrupt_answer_id": corrupt_answer.ids[0] if corrupt_answer else None,
        "clean_answer_ids": list(clean_answer.ids) if clean_answer else None,
        "corrupt_answer_ids": list(corrupt_answer.ids) if corrupt_answer else None,
        # a fact left without a partner records its own answer's policy (tracing scores it alone)
        "answer_policy": pair_policy(*scored) if scored else None,
        "subject_start": span[0] if has_span else None,
        "subject_end": span[1] if has_span else None,
        "roles": position_roles(len(clean.ids), *span) if has_span else None,
        "clean_logit_diff": judged.get("clean_logit_diff"),
        "corrupt_logit_diff": judged.get("corrupt_logit_diff"),
        "clean_logprob_diff": judged.get("clean_logprob_diff"),
        "corrupt_logprob_diff": judged.get("corrupt_logprob_diff"),
        "usable_alone": bool(usable_alone and has_span),
        "known_alone": known_alone,
    }


def build_from_source(model: str, source: str, fmt: str | None = None, *, seed: int = 0,
                      answer_policy: str = "full", engine=None,
                      require_known: bool | None = None) -> tuple[str, list[Record], list[dict]]:
    """Read a data set and pair and align it with `model`'s tokenizer; with an engine, ask the model
    which facts it knows alone, and (require_known, by default with an engine) keep only pairs it
    knows. Returns (format, records, one row per record)."""
    from transformers import AutoConfig, AutoTokenizer

    from ..models import prepare
    from ..sites import shape_of

    folder = prepare(model)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    fmt, records = read_source(source, fmt)
    max_len = shape_of(AutoConfig.from_pretrained(folder, trust_remote_code=False)).max_len
    rows = build_pairs(records, tokenizer, max_len=max_len, seed=seed, answer_policy=answer_policy, engine=engine,
                       require_known=engine is not None if require_known is None else require_known)
    return fmt, records, rows
