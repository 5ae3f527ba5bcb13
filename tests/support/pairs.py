"""Pairs from the shipped fact set, for cache and sweep tests; source records written by hand, for
the pair-building tests."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from patchgrid.pairs import accepted_pairs, build_pairs, read_source, to_table

DATA = Path(__file__).resolve().parents[2] / "data" / "pairs" / "facts.jsonl"


def shipped_pairs(tokenizer, n, *, engine=None, max_len=1024, spread=True, answer_policy="single"):
    """The first n accepted pairs, taken round-robin over relations so every relation shows up
    (one-token answers unless `answer_policy` says otherwise)."""
    _, recs = read_source(str(DATA))
    rows = build_pairs(recs, tokenizer, max_len=max_len, engine=engine, require_known=engine is not None,
                       answer_policy=answer_policy)
    pairs = accepted_pairs(to_table(rows))
    if not spread:
        return pairs[:n]
    by = defaultdict(list)
    for p in pairs:
        by[p.relation].append(p)
    out = []
    while len(out) < n and any(by.values()):
        for rel in sorted(by):
            if by[rel] and len(out) < n:
                out.append(by[rel].pop(0))
    return out


def noise_std_for(engine, pairs, scale: float = 3.0) -> float:
    """Causal tracing's noise for `pairs`: scale x the std of their subjects' embeddings in context."""
    from patchgrid.cache import CacheSpec, MemoryStore
    from patchgrid.sweeps import trace_noise_std

    return trace_noise_std(MemoryStore(engine, pairs, CacheSpec(("embed",))), pairs, scale)


def cf(case_id, subject, answer, prompt="The capital of {} is", relation="P36"):
    """One CounterFact record."""
    return {"case_id": case_id, "requested_rewrite": {"prompt": prompt, "relation_id": relation, "subject": subject,
                                                      "target_true": {"str": answer, "id": None}}}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
