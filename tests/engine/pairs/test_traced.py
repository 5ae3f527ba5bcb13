"""Which facts causal tracing runs on: those the model knows alone (top-1 prediction the answer),
with a subject-swap partner or not, as Meng et al. choose them."""
from __future__ import annotations

from patchgrid.pairs import build_pairs, read_source
from tests.support.pairs import DATA


def test_asking_the_model_marks_known_facts_without_filtering_pairs(engines, tokenizers):
    """With an engine but no require_known (a study that traces), every usable fact gets known_alone
    and the pairs are those a build without the model gives."""
    tok = tokenizers("tiny-llama")
    _, recs = read_source(str(DATA))
    recs = recs[:120]
    plain = build_pairs(recs, tok, max_len=1024)
    asked = build_pairs(recs, tok, max_len=1024, engine=engines.get("tiny-llama", "hf", dtype="float32"),
                        require_known=False)
    assert [(r["status"], r["reason"]) for r in asked] == [(r["status"], r["reason"]) for r in plain]
    assert all(r["known_alone"] is not None for r in asked if r["usable_alone"])
    assert all(r["known_alone"] is None for r in plain)

