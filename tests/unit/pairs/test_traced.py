"""Which facts causal tracing runs on: those the model knows alone (top-1 prediction the answer),
with a subject-swap partner or not, as Meng et al. choose them."""
from __future__ import annotations

from patchgrid.pairs import to_table, traced_facts


def row(pid, status, *, known, usable=True, reason=None, corrupt=(1, 9, 3)):
    return {"pair_id": pid, "status": status, "reason": reason, "usable_alone": usable, "known_alone": known,
            "clean_ids": [1, 2, 3], "corrupt_ids": list(corrupt) if status == "accepted" else None,
            "clean_answer_id": 7, "corrupt_answer_id": 8 if status == "accepted" else None, "subject_start": 1,
            "subject_end": 2, "roles": ["before_subject", "subject_last", "last"]}


def test_known_facts_are_traced_with_or_without_a_partner():
    table = to_table([
        row("paired-known", "accepted", known=True),
        row("alone-known", "rejected", known=True, reason="no_partner"),
        row("paired-unknown", "accepted", known=False),  # an accepted pair the model does not rank first
        row("unknown", "rejected", known=False, reason="not_known_clean"),
        row("not-usable", "rejected", known=None, usable=False, reason="answer_multi_token"),
        row("never-asked", "rejected", known=None, reason="no_partner"),  # no model was asked
    ])
    facts = traced_facts(table)
    assert [f.pair_id for f in facts] == ["paired-known", "alone-known"]
    paired, alone = facts
    assert paired.corrupt_ids == (1, 9, 3) and paired.corrupt_answer_id == 8
    # tracing reads only the clean side: a fact with no partner stands in for its own corrupt prompt
    assert alone.corrupt_ids == alone.clean_ids and alone.corrupt_answer_id == alone.clean_answer_id == 7
    assert [f.pair_id for f in traced_facts(table, limit=1)] == ["paired-known"]

