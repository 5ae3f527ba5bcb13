"""Records -> clean/corrupt pairs, one output row per input record, accepted or rejected with a reason.

Facts are paired by subject swap: fact A's prompt is clean, the same template with the subject of
another fact B of the same relation is corrupt; B's subject has as many tokens as A's and its
answer differs. The partner is drawn by a generator seeded per fact, so a rerun gives the same
pairs. Explicit pairs (patchgrid's own format) are checked as they are.
"""
from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from ..plan import Request
from ..rows import ANSWER_POLICIES
from .align import Prompt, Rejection, align, answer_id, check_fits, position_roles, tokenize_with_subject
from .sources import Record, read_source


@dataclass
class _Fact:
    rec: Record
    prompt: Prompt
    answer_id: int
    cut: bool


def build_pairs(records: list[Record], tokenizer, *, max_len: int, seed: int = 0, answer_policy: str = "single",
                engine=None, require_known: bool = False) -> list[dict]:
    if answer_policy not in ANSWER_POLICIES:
        raise ValueError(f"unknown answer policy {answer_policy!r}; use one of {', '.join(ANSWER_POLICIES)}")
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
    _pair_facts(facts, rows, seed, engine, require_known)
    _check_explicit(records, pairs, rows, tokenizer, answer_policy, max_len, engine, require_known)
    return rows


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
    aid, cut = answer_id(tok, rec.prompt, rec.answer, policy, "clean")
    return _Fact(rec, prompt, aid, cut)


def _pair_facts(facts: dict[int, _Fact], rows, seed: int, engine, require_known: bool) -> None:
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, f in facts.items():
        groups[(f.rec.relation, f.rec.template)].append(i)
    logits = _fact_logits(facts, groups, engine) if engine is not None and facts else None
    for i, a in facts.items():
        span = a.prompt.span[1] - a.prompt.span[0]
        cands = [j for j in groups[(a.rec.relation, a.rec.template)]
                 if j != i and facts[j].answer_id != a.answer_id
                 and facts[j].prompt.span[1] - facts[j].prompt.span[0] == span]
        random.Random(f"{seed}:{a.rec.record_id}").shuffle(cands)
        known_alone = None if logits is None else logits[i]["top"] == a.answer_id
        aligned = clean_known = 0
        chosen = None
        for j in cands:
            b = facts[j]
            try:
                align(a.prompt, b.prompt)
            except Rejection:
                continue
            aligned += 1
            lds = None
            if logits is not None:
                lds = (logits[i][a.answer_id] - logits[i][b.answer_id], logits[j][a.answer_id] - logits[j][b.answer_id])
            if require_known:
                if lds[0] <= 0:
                    continue
                clean_known += 1
                if lds[1] >= 0:
                    continue
            chosen = (b, lds)
            break
        common = dict(usable_alone=True, known_alone=known_alone)
        if chosen is None:
            if not aligned:
                reason = ("no_partner", f"no other fact of relation {a.rec.relation!r} with this template, a "
                                        f"{span}-token subject and a different answer lines up with it")
            elif not clean_known:
                reason = ("not_known_clean", f"the model does not prefer {a.rec.answer!r} over any partner's answer")
            else:
                reason = ("not_known_corrupt", "no partner's corrupt prompt makes the model prefer its own answer")
            rows[i] = _row(a.rec, reason=reason, clean=a.prompt, clean_answer_id=a.answer_id, **common)
            continue
        b, lds = chosen
        rows[i] = _row(a.rec, clean=a.prompt, corrupt=b.prompt, corrupt_prompt=b.rec.prompt,
                       corrupt_subject=b.rec.subject, corrupt_answer=b.rec.answer, clean_answer_id=a.answer_id,
                       corrupt_answer_id=b.answer_id, policy="first-token" if a.cut or b.cut else "single",
                       lds=lds, **common)


def _fact_logits(facts, groups, engine) -> dict[int, dict]:
    """One batched call: every fact's logits for every answer of its group, and its top token."""
    order, reqs = [], []
    for members in groups.values():
        answers = tuple(sorted({facts[j].answer_id for j in members}))
        for j in members:
            order.append((j, answers))
            reqs.append(Request(tokens=facts[j].prompt.ids, answers=answers, top_k=1))
    out = {}
    for (j, answers), res in zip(order, engine.run(reqs)):
        d = {a: float(v) for a, v in zip(answers, res.answer_logits)}
        d["top"] = res.top_ids[0]
        out[j] = d
    return out


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
            a, cut_a = answer_id(tok, rec.clean_prompt, rec.clean_answer, policy, "clean")
            b, cut_b = answer_id(tok, rec.corrupt_prompt, rec.corrupt_answer, policy, "corrupt")
            if a == b:
                raise Rejection("same_answer", f"clean and corrupt answers are the same token ({rec.clean_answer!r})")
        except Rejection as r:
            rows[i] = _row(rec, reason=(r.code, r.detail))
            continue
        rows[i] = _row(rec, clean=clean, corrupt=corrupt, corrupt_prompt=rec.corrupt_prompt,
                       corrupt_subject=rec.corrupt_subject, corrupt_answer=rec.corrupt_answer, clean_answer_id=a,
                       corrupt_answer_id=b, policy="first-token" if cut_a or cut_b else "single",
                       usable_alone=rec.subject is not None)
        ok.append(i)
    if engine is None or not ok:
        return
    reqs = []
    for i in ok:
        r = rows[i]
        answers = (r["clean_answer_id"], r["corrupt_answer_id"])
        reqs += [Request(tokens=tuple(r["clean_ids"]), answers=answers, top_k=1),
                 Request(tokens=tuple(r["corrupt_ids"]), answers=answers)]
    res = engine.run(reqs)
    for k, i in enumerate(ok):
        c, d = res[2 * k], res[2 * k + 1]
        cl, co = float(c.answer_logits[0] - c.answer_logits[1]), float(d.answer_logits[0] - d.answer_logits[1])
        row = rows[i]
        row.update(clean_logit_diff=cl, corrupt_logit_diff=co, known_alone=c.top_ids[0] == row["clean_answer_id"])
        if not require_known:
            continue
        if cl <= 0:
            row.update(status="rejected", reason="not_known_clean",
                       detail=f"clean logit difference {cl:+.3f} is not positive")
        elif co >= 0:
            row.update(status="rejected", reason="not_known_corrupt",
                       detail=f"corrupt logit difference {co:+.3f} is not negative")


# ---- rows ----

def _row(rec: Record, *, reason=None, clean: Prompt | None = None, corrupt: Prompt | None = None,
         corrupt_prompt=None, corrupt_subject=None, corrupt_answer=None, clean_answer_id=None,
         corrupt_answer_id=None, policy=None, lds=None, usable_alone=False, known_alone=None) -> dict:
    span = clean.span if clean is not None else (None, None)
    has_span = clean is not None and span[1] > span[0]
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
        "corrupt_answer": corrupt_answer if corrupt is not None else (rec.corrupt_answer if rec.is_pair else None),
        "clean_ids": list(clean.ids) if clean is not None else None,
        "corrupt_ids": list(corrupt.ids) if corrupt is not None else None,
        "clean_answer_id": clean_answer_id,
        "corrupt_answer_id": corrupt_answer_id,
        "answer_policy": policy,
        "subject_start": span[0] if has_span else None,
        "subject_end": span[1] if has_span else None,
        "roles": position_roles(len(clean.ids), *span) if has_span else None,
        "clean_logit_diff": lds[0] if lds else None,
        "corrupt_logit_diff": lds[1] if lds else None,
        "usable_alone": bool(usable_alone and has_span),
        "known_alone": known_alone,
    }


def build_from_source(model: str, source: str, fmt: str | None = None, *, seed: int = 0,
                      answer_policy: str = "single", engine=None,
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
