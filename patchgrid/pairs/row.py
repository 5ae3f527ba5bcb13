"""One output row per input record: a pair accepted, or a record rejected with its reason."""
from __future__ import annotations

from .align import Answer, Prompt, pair_policy, position_roles
from .sources import Record


def pair_row(rec: Record, *, reason=None, clean: Prompt | None = None, corrupt: Prompt | None = None,
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
