"""Records -> clean/corrupt pairs, one output row per input record, accepted or rejected with a reason.

Facts are paired by subject swap (facts.py); explicit pairs (patchgrid's own format) are checked
as they are (explicit.py). With an engine, every fact is asked whether the model knows it alone,
and with require_known only the pairs the model knows are kept (known.py).
"""
from __future__ import annotations

from collections import defaultdict

from ..rows.shapes import ANSWER_POLICIES
from .align import Rejection
from .explicit import check_explicit
from .facts import Fact, fact_of, pair_facts
from .limit import Limit
from .row import pair_row
from .sources import Record, read_source


def build_pairs(records: list[Record], tokenizer, *, max_len: int, seed: int = 0, answer_policy: str = "full",
                engine=None, require_known: bool = False, limit: Limit | None = None) -> list[dict]:
    """One row per record. With an engine, records are judged in the data set's order; with a
    `limit`, only until the records judged hold its N members (limit.py)."""
    check_answer_policy(answer_policy)
    if require_known and engine is None:
        raise ValueError("require_known needs an engine")
    rows: list[dict | None] = [None] * len(records)
    facts: dict[int, Fact] = {}
    pairs: list[int] = []
    for i, rec in enumerate(records):
        if rec.problem is not None:
            rows[i] = pair_row(rec, reason=rec.problem)
        elif rec.is_pair:
            pairs.append(i)
        else:
            try:
                facts[i] = fact_of(tokenizer, rec, answer_policy, max_len)
            except Rejection as r:
                rows[i] = pair_row(rec, reason=(r.code, r.detail), usable_alone=False)
    # with an engine, every fact is asked whether the model knows it alone (causal tracing's
    # facts); pairs are filtered by what the model knows only with require_known
    pair_facts(facts, rows, tokenizer, seed, engine, require_known, limit)
    check_explicit(records, pairs, rows, tokenizer, answer_policy, max_len, engine, require_known, limit)
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


def build_from_source(model: str, source: str, fmt: str | None = None, *, seed: int = 0,
                      answer_policy: str = "full", engine=None, require_known: bool | None = None,
                      limit: Limit | None = None) -> tuple[str, list[Record], list[dict]]:
    """Read a data set and pair and align it with `model`'s tokenizer; with an engine, ask the model
    which facts it knows alone, and (require_known, by default with an engine) keep only pairs it
    knows; with a `limit`, only until the records judged hold its N members. Returns (format,
    records, one row per record)."""
    from transformers import AutoConfig, AutoTokenizer

    from ..model.models import prepare
    from ..model.sites import shape_of

    folder = prepare(model)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    fmt, records = read_source(source, fmt)
    max_len = shape_of(AutoConfig.from_pretrained(folder, trust_remote_code=False)).max_len
    rows = build_pairs(records, tokenizer, max_len=max_len, seed=seed, answer_policy=answer_policy, engine=engine,
                       require_known=engine is not None if require_known is None else require_known, limit=limit)
    return fmt, records, rows
