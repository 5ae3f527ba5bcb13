"""Which facts causal tracing runs on under each --trace-facts rule: first-token (the default: the
answer's first token is the model's top-1 next token) and rome (ROME's calculate_hidden_flow: the
top-1 next token is the whole answer, so answers of several tokens are out), each fact left out
with its reason."""
from __future__ import annotations

import pytest

from patchgrid.pairs import build_pairs, read_source, to_table
from patchgrid.pairs.known import TRACE_FACTS
from patchgrid.plan import Request
from patchgrid.sweeps.config import SweepConfig
from patchgrid.sweeps.populations import TRACED_FACTS, trace_left_out
from tests.support.pairs import DATA


@pytest.mark.slow
def test_smollm2_traces_a_several_token_answer_by_default_and_not_by_romes_rule(engines, tokenizers):
    """Two shipped facts the model knows alone: "The capital of United Arab Emirates is" -> "Abu
    Dhabi" (several tokens, the first top-1) is traced by default and left out by ROME's rule as
    not_whole_answer; "The official language of United Arab Emirates is" -> "Arabic" (its top-1
    next token, decoded and stripped, is the answer, ROME's check) by both."""
    engine, tok = engines.get("smollm2-135m", "hf"), tokenizers("smollm2-135m")
    _, recs = read_source(str(DATA))
    recs = [r for r in recs if r.record_id in ("0", "2")]
    table = to_table(build_pairs(recs, tok, max_len=engine.shape.max_len, engine=engine, require_known=False))
    rows = {r["pair_id"]: r for r in table.to_pylist()}
    for pid, answer in (("0", "Abu Dhabi"), ("2", "Arabic")):
        row = rows[pid]
        assert row["clean_answer"] == answer and row["usable_alone"]
        [res] = engine.run([Request(tokens=tuple(row["clean_ids"]), top_k=1)])
        top = res.top_ids[0]
        whole = tok.encode(" " + answer, add_special_tokens=False)
        assert top == whole[0]  # the model's top-1 next token is the answer's first token
        assert (tok.decode([top]).strip() == answer) == (len(whole) == 1) == (pid == "2")
    traced = {rule: [f.pair_id for f in TRACED_FACTS.members(table, None, SweepConfig(trace_facts=rule))]
              for rule in TRACE_FACTS}
    assert traced == {"first-token": ["0", "2"], "rome": ["2"]}
    assert [(p, r) for p, r, _ in trace_left_out(table, "rome")] == [("0", "not_whole_answer")]

