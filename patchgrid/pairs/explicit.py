"""Explicit pairs (patchgrid's own format: a clean and a corrupt prompt, each with its answer),
checked as they are; with an engine, asked whether the model knows them."""
from __future__ import annotations

from .align import Prompt, Rejection, align, answer_ids, check_fits, check_follows, tokenize_with_subject
from .facts import Judging
from .known import Scorer, unknown_side
from .limit import Limit, batches
from .row import pair_row


def check_explicit(records, idx, rows, tok, policy, max_len, engine, require_known: bool,
                   limit: Limit | None = None) -> None:
    """The row of each explicit pair `records[i]` (i in `idx`) in `rows`; with an engine, its
    known-check numbers, and with require_known the pairs the model does not know rejected. The
    pairs are judged in the data set's order, in batches; with a `limit`, judging stops once the
    pairs judged hold its N members, and the rest are rejected as not judged (limit_reached)."""
    ok = []
    for i in idx:
        rec = records[i]
        try:
            clean, corrupt, a, b = _aligned(rec, tok, policy, max_len)
        except Rejection as r:
            rows[i] = pair_row(rec, reason=(r.code, r.detail))
            continue
        rows[i] = pair_row(rec, clean=clean, corrupt=corrupt, corrupt_prompt=rec.corrupt_prompt,
                           corrupt_subject=rec.corrupt_subject, corrupt_answer_text=rec.corrupt_answer,
                           clean_answer=a, corrupt_answer=b, usable_alone=rec.subject is not None)
        ok.append((i, a, b))
    if engine is None or not ok:
        return
    scorer = Scorer(engine)
    judging = Judging("judging pairs", len(ok), rows)
    done = 0
    for batch in batches(list(range(len(ok))), limit):
        _judge([ok[k] for k in batch], rows, scorer, require_known)
        done += len(batch)
        judging.batch_done(done)
        if limit is not None and done < len(ok) and limit.reached(rows[:ok[batch[-1]][0] + 1]):
            break
    for i, _, _ in ok[done:]:  # not reached: the limit was
        reason, detail = limit.reason()
        rows[i].update(status="rejected", reason=reason, detail=detail)


def _aligned(rec, tok, policy, max_len):
    """(clean prompt, corrupt prompt, clean answer, corrupt answer) of an explicit pair that lines
    up; a Rejection otherwise."""
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
    return clean, corrupt, a, b


def _judge(ok, rows, scorer: Scorer, require_known: bool) -> None:
    """One engine call scoring the aligned pairs `ok` ((row index, clean answer, corrupt answer)):
    their known-check numbers and known_alone into their rows; with require_known, the pairs the
    model does not know rejected."""
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
        unknown = unknown_side(judged)
        if unknown is not None:
            reason, detail = unknown
            row.update(status="rejected", reason=reason, detail=detail)
