"""Which facts causal tracing runs on under each --trace-facts rule: first-token (the default: the
answer's first token is the model's top-1 next token) and rome (ROME's calculate_hidden_flow: the
top-1 next token is the whole answer, so answers of several tokens are out), each fact left out
with its reason."""
from __future__ import annotations

import pytest

from patchgrid.pairs import to_table
from patchgrid.pairs.known import TRACE_FACTS, trace_rejection
from patchgrid.pipeline.spec import StudySpec
from patchgrid.rows.shapes import REASONS
from patchgrid.settings import SpecError
from patchgrid.sweeps.config import SweepConfig
from patchgrid.sweeps.populations import TRACED_FACTS, nothing_to_run, trace_left_out


def row(pid, *, known, answer=(7,), policy=None, usable=True, status="rejected"):
    return {"pair_id": pid, "status": status, "reason": None if status == "accepted" else "no_partner",
            "usable_alone": usable, "known_alone": known, "clean_ids": [1, 2, 3], "clean_answer_id": answer[0],
            "clean_answer_ids": list(answer), "answer_policy": policy or ("single" if len(answer) == 1 else "full"),
            "subject_start": 1, "subject_end": 2, "roles": ["before_subject", "subject_last", "last"]}


FACTS = [
    row("one-token", known=True),                       # " Paris" is top-1: traced by both rules
    row("several", known=True, answer=(7, 9)),          # " New" " York", " New" top-1: first-token only
    row("cut", known=True, policy="first-token"),       # cut to its first token: not whole, first-token only
    row("unknown", known=False),                        # top-1 is not the answer's first token: neither
    row("unknown-several", known=False, answer=(5, 6)),
    row("not-usable", known=None, usable=False),        # rejected before the model was asked: no verdict
]


def test_the_two_rules_on_each_kind_of_fact():
    want = {"first-token": ["one-token", "several", "cut"], "rome": ["one-token"]}
    table = to_table(FACTS)
    for rule in TRACE_FACTS:
        assert [f.pair_id for f in TRACED_FACTS.members(table, None, SweepConfig(trace_facts=rule))] == want[rule]
        kept = [r["pair_id"] for r in FACTS if r["usable_alone"] and trace_rejection(rule, r) is None]
        assert kept == want[rule]
    # the default is today's rule, and a limit keeps the first N under the rule
    assert SweepConfig().trace_facts == "first-token"
    assert [f.pair_id for f in TRACED_FACTS.members(table, 2, SweepConfig())] == ["one-token", "several"]


def test_what_a_rule_leaves_out_is_recorded_with_its_reason():
    table = to_table(FACTS)
    assert [(p, r) for p, r, _ in trace_left_out(table, "first-token")] == [
        ("unknown", "not_known_alone"), ("unknown-several", "not_known_alone")]
    out = trace_left_out(table, "rome")
    assert [(p, r) for p, r, _ in out] == [("several", "not_whole_answer"), ("cut", "not_whole_answer"),
                                           ("unknown", "not_known_alone"), ("unknown-several", "not_known_alone")]
    assert "2 tokens" in out[0][2] and "first-token" in out[1][2]
    assert {r for _, r, _ in out} <= set(REASONS)
    with pytest.raises(ValueError, match="unknown trace-facts rule 'meng'"):
        trace_rejection("meng", FACTS[0])


def test_a_study_with_nothing_to_trace_says_what_the_rule_left_out():
    table = to_table([f for f in FACTS if f["pair_id"] in ("several", "cut", "unknown")])
    line = nothing_to_run(TRACED_FACTS, table, "f.jsonl", "w.duckdb", "run-1", SweepConfig(trace_facts="rome"))
    assert "(0 of 3 records accepted: no_partner 3; left out by --trace-facts rome: not_whole_answer 2, " \
           "not_known_alone 1)" in line
    assert "--trace-facts first-token traces the others too" in line
    assert "left out by" not in nothing_to_run(TRACED_FACTS, table, "f.jsonl", "w.duckdb", "run-1")


def test_the_setting_belongs_to_the_trace_sweep():
    """--trace-facts is refused without the trace sweep, recorded when it is not the default."""
    assert StudySpec.of(sweeps="resid,trace", trace_facts="rome").recorded_params()["trace_facts"] == "rome"
    assert "trace_facts" not in StudySpec.of(sweeps="resid,trace").recorded_params()
    with pytest.raises(SpecError, match="trace"):
        StudySpec.of(sweeps="resid", trace_facts="rome")
    with pytest.raises(SpecError, match="first-token"):
        SweepConfig(trace_facts="meng")

