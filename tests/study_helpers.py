"""Pairs from the shipped fact set, for cache and sweep tests."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from patchgrid.pairs import accepted_pairs, build_pairs, read_source, to_table

DATA = Path(__file__).resolve().parents[1] / "data" / "pairs" / "facts.jsonl"


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
