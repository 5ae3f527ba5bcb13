"""trace_buckets on hand-built trace rows, against Meng et al.'s buckets written out in Python as
ROME's notebook forms them (notebooks/average_causal_effects.ipynb, read_knowlege): per prompt
scores[first_e], scores[first_e+1:last_e], scores[last_e], scores[first_a],
scores[first_a+1:last_a], scores[last_a], with (first_e, first_a) the subject's token range,
last_e = first_a - 1 and last_a the last token; each bucket's mean over every token put in it."""
from __future__ import annotations

import statistics

import pytest

from patchgrid.pairs import to_table as pairs_table
from patchgrid.pairs.align import position_roles, tokenize_with_subject
from patchgrid.rows.effects import write_effects
from patchgrid.sweeps.registry import row_shapes
from patchgrid.warehouse.loader import load_run, query, start_run
from tests.support.effect_rows import CLEAN, CORRUPT, make_pair, row, shifted

BUCKETS = ("first_subject", "middle_subject", "last_subject", "first_subsequent", "further", "last")

# (prompt, n tokens, subject [start, end), restored p per token, noised p)
PROMPTS = [
    # "The capital of France is": the one-token subject ends right before the last token
    ("france", 5, (3, 4), [0.05, 0.06, 0.07, 0.61, 0.44], 0.04),
    # "Paris is the capital of": a one-token subject, then further tokens
    ("paris", 5, (0, 1), [0.52, 0.31, 0.12, 0.09, 0.27], 0.08),
    # "The Eiffel Tower is located in": a three-token subject, then further tokens
    ("eiffel", 7, (1, 4), [0.10, 0.33, 0.21, 0.58, 0.17, 0.14, 0.36], 0.11),
    # "In Danielle Darrieux is"-like: a two-token subject after one token, ending right before the last token
    ("darrieux", 4, (1, 3), [0.02, 0.29, 0.47, 0.51], 0.03),
]


def rome_buckets(prompts) -> dict[str, list[float]]:
    """Each bucket's scores, as read_knowlege adds them (avg_fe, avg_ee, avg_le, avg_fa, avg_ea,
    avg_la), over `prompts`. A subject ending at the last token (first_a past the end) has no
    first subsequent token: ROME's scores[first_a] would be out of range there."""
    out: dict[str, list[float]] = {b: [] for b in BUCKETS}
    for _, _, (first_e, first_a), scores, _ in prompts:
        last_e, last_a = first_a - 1, len(scores) - 1
        out["first_subject"].append(scores[first_e])
        out["middle_subject"] += scores[first_e + 1:last_e]
        out["last_subject"].append(scores[last_e])
        if first_a < len(scores):
            out["first_subsequent"].append(scores[first_a])
        out["further"] += scores[first_a + 1:last_a]
        out["last"].append(scores[last_a])
    return {b: v for b, v in out.items() if v}


def trace_warehouse(tmp_path, prompts, params=None):
    pairs, rows = [], []
    for pid, n, (start, end), scores, noised in prompts:
        assert len(scores) == n
        roles = position_roles(n, start, end)  # the roles patchgrid gives these positions
        pairs.append({"pair_id": pid, "relation": "r", "status": "accepted", "clean_prompt": pid,
                      "corrupt_prompt": pid, "roles": roles, "subject_start": start, "subject_end": end})
        clean, corrupt = shifted(CLEAN, p=0.9), shifted(CORRUPT, p=noised)
        for pos, p in enumerate(scores):
            rows.append(row(make_pair(pid, roles, subject=(start, end)), 0.0, sweep="trace", position=pos,
                            metric="p", clean=clean, corrupt=corrupt, patched=shifted(corrupt, p=p)))
    wh = tmp_path / "w.duckdb"
    start_run(wh, {"run_id": "r", "model": "m", **({"params": params} if params else {})})
    load_run(wh, "r", pairs_table(pairs), [], [write_effects(rows, tmp_path / "e.parquet")], sweep_kinds=row_shapes())
    cols, got = query(wh, "SELECT * FROM trace_buckets WHERE site = 'resid' AND metric = 'p'")
    return {r["bucket"]: r for r in (dict(zip(cols, x)) for x in got)}


def test_buckets_are_romes(tmp_path):
    """Every bucket holds the tokens ROME's notebook puts in it: the last token of "The capital of
    France is" is in first_subsequent and last, a one-token subject's token in first and last
    subject; each bucket's mean restored p is ROME's bucket average. Where every prompt gives the
    bucket one token, the indirect effect is ROME's too: that average less the noised p averaged
    over every prompt."""
    got = trace_warehouse(tmp_path, PROMPTS)
    want = rome_buckets(PROMPTS)
    assert set(got) == set(want) == set(BUCKETS)
    assert got["first_subsequent"]["n_prompts"] == got["first_subsequent"]["n_tokens"] == len(PROMPTS)
    low = statistics.mean(noised for *_, noised in PROMPTS)  # ROME's avg_ls
    for bucket, scores in want.items():
        assert got[bucket]["n_tokens"] == len(scores), bucket
        assert got[bucket]["mean_restored"] == pytest.approx(statistics.mean(scores), rel=1e-6), bucket
    for bucket in ("first_subject", "last_subject", "first_subsequent", "last"):
        assert got[bucket]["aie"] == pytest.approx(statistics.mean(want[bucket]) - low, rel=1e-5), bucket
    # middle and further: tokens of some prompts only, each less its own prompt's noised p
    noised = {pid: x for pid, *_, x in PROMPTS}
    for bucket, role in (("middle_subject", "subject_middle"), ("further", "further")):
        effects = [s - noised[pid] for pid, n, span, scores, _ in PROMPTS
                   for s, r in zip(scores, position_roles(n, *span)) if r == role]
        assert got[bucket]["aie"] == pytest.approx(statistics.mean(effects), rel=1e-5), bucket


def test_the_capital_of_france_tokenized(tokenizers):
    """The tiny model's tokenizer gives "The capital of France is" the span and roles the France
    case above is built on: " France" the subject's one token, " is" right after it and last."""
    tok = tokenizers("tiny-llama")
    prompt = tokenize_with_subject(tok, "The capital of France is", "France")
    assert [tok.decode([i]) for i in prompt.ids][3:] == [" France", " is"]
    assert (len(prompt.ids), prompt.span) == (PROMPTS[0][1], PROMPTS[0][2])
    assert position_roles(len(prompt.ids), *prompt.span)[3:] == ["subject_last", "last"]


def test_the_capital_of_france_alone(tmp_path):
    """One prompt, "The capital of France is": its last token is the first subsequent token, its
    subject's one token the first and the last subject token; nothing is in middle or further."""
    got = trace_warehouse(tmp_path, PROMPTS[:1])
    scores = PROMPTS[0][3]
    assert {b: r["mean_restored"] for b, r in got.items()} == pytest.approx(
        {"first_subject": scores[3], "last_subject": scores[3], "first_subsequent": scores[4], "last": scores[4]})


def test_a_subject_ending_at_the_last_token(tmp_path):
    """patchgrid's rule where ROME has none: a subject whose last token is the prompt's last is
    counted in last_subject and last (and first_subject if one token), and the prompt has no first
    subsequent token."""
    prompts = [("at_end", 4, (2, 4), [0.03, 0.05, 0.22, 0.64], 0.02),
               ("one_at_end", 3, (2, 3), [0.04, 0.06, 0.71], 0.05), *PROMPTS[1:3]]
    got = trace_warehouse(tmp_path, prompts)
    want = rome_buckets(prompts)
    assert got["first_subsequent"]["n_prompts"] == 2 and got["last_subject"]["n_prompts"] == 4
    for bucket, scores in want.items():
        assert got[bucket]["n_tokens"] == len(scores), bucket
        assert got[bucket]["mean_restored"] == pytest.approx(statistics.mean(scores), rel=1e-6), bucket


@pytest.mark.parametrize("params, rule", [(None, "first-token"), ({"trace_facts": "rome"}, "rome")])
def test_every_row_names_the_rule_that_chose_its_facts(tmp_path, params, rule):
    """trace_facts: the run's recorded rule; a run that records none traced by the default."""
    got = trace_warehouse(tmp_path, PROMPTS[:2], params)
    assert {r["trace_facts"] for r in got.values()} == {rule}
