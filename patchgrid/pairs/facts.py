"""Facts paired by subject swap: fact A's prompt is clean, the same template with the subject of
another fact B of the same relation is corrupt; B's subject has as many tokens as A's and its
answer differs. The partner is drawn by a generator seeded per fact, so a rerun gives the same
pairs."""
from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from itertools import islice

from ..runtime.progress import report
from .align import Answer, Prompt, Rejection, align, answer_ids, check_fits, check_follows, tokenize_with_subject
from .known import Scorer, unknown_side
from .limit import Limit, batches
from .row import pair_row
from .sources import Record


@dataclass
class Fact:
    rec: Record
    prompt: Prompt
    answer: Answer

    @property
    def answer_ids(self) -> tuple[int, ...]:
        return self.answer.ids



def fact_of(tok, rec: Record, policy: str, max_len: int) -> Fact:
    start = rec.template.index("{}")
    prompt = tokenize_with_subject(tok, rec.prompt, rec.subject, start)
    check_fits(len(prompt.ids), max_len, "clean")
    return Fact(rec, prompt, answer_ids(tok, rec.prompt, prompt.ids, rec.answer, policy, "clean", max_len))


def pair_facts(facts: dict[int, Fact], rows, tok, seed: int, engine, require_known: bool,
               limit: Limit | None = None) -> None:
    """The row of every fact in `rows`: paired with its first partner that lines up (and, with
    require_known, that the model knows both ways). With an engine, facts are judged in the data
    set's order, in batches; with a `limit`, judging stops once the facts judged hold its N members,
    and the rest are rejected as not judged (limit_reached)."""
    walks = _walks(facts, tok, seed)
    scorer = Scorer(engine) if engine is not None and facts else None
    order = list(facts)  # in record order
    judging = Judging("judging facts", len(order), rows) if scorer is not None else None
    done = 0
    for batch in batches(order, limit if scorer is not None else None):
        _decide([walks[i] for i in batch], scorer, require_known, judging)
        for i in batch:
            rows[i] = _fact_row(facts[i], walks[i], scorer)
        done += len(batch)
        if judging is not None:
            judging.batch_done(done)
        if limit is not None and done < len(order) and limit.reached(rows[:batch[-1] + 1]):
            break
    for i in order[done:]:  # not reached: the limit was
        a = facts[i]
        rows[i] = pair_row(a.rec, reason=limit.reason(), clean=a.prompt, clean_answer=a.answer, usable_alone=True)


class Judging:
    """What the caller is told while records are judged (patchgrid.runtime.progress): records decided of
    all, and the pairs accepted so far."""

    def __init__(self, stage: str, total: int, rows):
        self.stage, self.total, self.rows, self.base = stage, total, rows, 0
        report(stage, 0, total)

    def round_done(self, decided: int, chosen: int) -> None:
        """A round of the current batch: `decided` of its records decided, `chosen` of them accepted."""
        self._tell(self.base + decided, chosen)

    def batch_done(self, done: int) -> None:
        self.base = done
        self._tell(done, 0)

    def _tell(self, done: int, chosen: int) -> None:
        accepted = sum(1 for r in self.rows if r is not None and r["status"] == "accepted") + chosen
        report(self.stage, done, self.total, f"{accepted} pairs accepted")


def _walks(facts: dict[int, Fact], tok, seed: int) -> dict[int, Walk]:
    """Each fact's search for a partner, through the facts of its relation and template whose subject
    has as many tokens and whose answer differs, in an order drawn by a generator seeded per fact."""
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
        walks[i] = Walk(facts, i, cands, tok)
    return walks


def _decide(walks: list[Walk], scorer: Scorer | None, require_known: bool, judging: Judging | None) -> None:
    """Walk `walks` until each is decided, asking the model (`scorer`) for the scores they need."""
    need: set = set()
    if scorer is not None:
        # every fact's own answer and top token (known_alone), whether it pairs or not; and every
        # one-token answer it may be paired with: read at the last prompt position of the forward
        # the prompt takes anyway, they cost nothing
        need = {(w.a.prompt.ids, w.a.answer_ids) for w in walks}
        need |= {(w.a.prompt.ids, w.facts[j].answer_ids) for w in walks for j in w.cands
                 if len(w.facts[j].answer_ids) == 1}
    # Partners are tried in their drawn order; the scores a fact's next candidates need are asked
    # for in rounds, one engine call each, twice as many candidates per fact each round. Scoring
    # every candidate up front costs a forward per multi-token answer per prompt (minutes on the
    # shipped facts); most facts take their first candidate.
    undecided = walks
    while undecided:
        for w in undecided:
            w.step(scorer, require_known, need)
        undecided = [w for w in undecided if not w.done]
        if judging is not None:
            judging.round_done(len(walks) - len(undecided), sum(w.chosen is not None for w in walks))
        if not need:
            break
        scorer.ask(need)
        need = set()


def _fact_row(a: Fact, w: Walk, scorer: Scorer | None) -> dict:
    known_alone = None if scorer is None else scorer.top[a.prompt.ids] == a.answer_ids[0]
    common = dict(usable_alone=True, known_alone=known_alone, clean_answer=a.answer)
    if w.chosen is None:
        return pair_row(a.rec, reason=w.reason(), clean=a.prompt, **common)
    b, judged = w.chosen
    return pair_row(a.rec, clean=a.prompt, corrupt=b.prompt, corrupt_prompt=b.rec.prompt,
                    corrupt_subject=b.rec.subject, corrupt_answer_text=b.rec.answer,
                    corrupt_answer=b.answer, judged=judged, **common)


class Walk:
    """One fact's search for a partner through its candidates, in their drawn order: the first that
    lines up (and, with require_known, that the model knows both ways) is its corrupt side."""

    def __init__(self, facts: dict[int, Fact], i: int, cands: list[int], tok):
        self.facts, self.a, self.cands, self.tok = facts, facts[i], cands, tok
        self.pos = 0
        self.ahead = 1  # candidates to ask scores for when the next one is not scored yet
        self.lined_up = self.clean_known = 0
        self.chosen: tuple[Fact, dict | None] | None = None
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

    def step(self, scorer: Scorer | None, require_known: bool, need: set) -> None:
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
                unknown = unknown_side(judged)
                if unknown is not None and unknown[0] == "not_known_clean":
                    continue
                self.clean_known += 1
                if unknown is not None:
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
