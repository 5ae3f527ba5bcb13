"""Every format is read into one shape; bad input gives an error naming file and line, or a rejection."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from patchgrid.pairs import SourceError, read_source
from tests.support.pairs import cf, write_jsonl


def test_known_1000(tmp_path):
    p = write_jsonl(tmp_path / "known.jsonl", [
        {"known_id": 0, "subject": "Vinson Massif", "attribute": "Antarctica",
         "template": "{} is located in the continent of", "prediction": " Antarctica",
         "prompt": "Vinson Massif is located in the continent of", "relation_id": "P30"}])
    fmt, [rec] = read_source(str(p))
    assert fmt == "known_1000"
    assert (rec.record_id, rec.relation, rec.subject, rec.answer) == ("0", "P30", "Vinson Massif", "Antarctica")
    assert rec.prompt == "Vinson Massif is located in the continent of"


def test_counterfact_nested(tmp_path):
    p = write_jsonl(tmp_path / "cf.jsonl", [cf(7, "France", "Paris")])
    fmt, [rec] = read_source(str(p))
    assert fmt == "counterfact" and rec.record_id == "7" and rec.prompt == "The capital of France is"


def test_counterfact_tracing_flat_as_json_array(tmp_path):
    p = tmp_path / "tracing.json"
    p.write_text(json.dumps([{"relation": "{} is a citizen of", "relation_prefix": "",
                              "relation_suffix": " is a citizen of", "prompt": "Danielle Darrieux is a citizen of",
                              "relation_id": "P27", "target_false_id": 1,
                              "target_true_id": 2, "target_true": " France", "target_false": " Italy",
                              "subject": "Danielle Darrieux"}]))
    fmt, [rec] = read_source(str(p))
    assert fmt == "counterfact_tracing"
    assert rec.template == "{} is a citizen of" and rec.answer == " France"


def test_patchgrid_pairs_from_parquet(tmp_path):
    p = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist([{"pair_id": "a", "clean_prompt": "The capital of France is",
                                          "corrupt_prompt": "The capital of Germany is", "clean_answer": " Paris",
                                          "corrupt_answer": " Berlin", "relation": "capital", "subject": "France"}]), p)
    fmt, [rec] = read_source(str(p))
    assert fmt == "patchgrid" and rec.is_pair and rec.record_id == "a"


def test_format_named_explicitly(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", [cf(1, "France", "Paris")])
    with pytest.raises(SourceError, match="unknown format 'rome'"):
        read_source(str(p), "rome")


@pytest.mark.parametrize("content, message", [
    (b"", "holds no records"),
    (b"\n\n", "holds no records"),
    (b'{"case_id": 1}\n{"case_id": 2,\n', "x.jsonl line 2: not valid JSON"),
    (b'{"a": 1}\n[1, 2]\n', "x.jsonl line 2: a record must be a JSON object"),
    ('{"subject": "Caf\u00e9"}\n'.encode("latin-1"), "x.jsonl line 1: not UTF-8 text"),
    (b'{"foo": 1, "bar": 2}\n', "unknown format: its fields ['bar', 'foo']"),
])
def test_structural_errors_name_file_and_line(tmp_path, content, message):
    p = tmp_path / "x.jsonl"
    p.write_bytes(content)
    with pytest.raises(SourceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_source(str(p))


def test_missing_files_and_types(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        read_source(str(tmp_path / "none.jsonl"))
    with pytest.raises(SourceError, match="is a folder"):
        read_source(str(tmp_path))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unsupported file type '.csv'"):
        read_source(str(tmp_path / "x.csv"))


def test_record_problems_are_recorded_not_dropped(tmp_path):
    records = [
        cf(1, "France", "Paris"),
        cf(2, "", "Berlin"),                                   # empty subject
        cf(1, "Spain", "Madrid"),                              # duplicate id
        {"case_id": 4, "requested_rewrite": {"prompt": "The capital of {} is", "relation_id": "P36",
                                             "subject": "Italy", "target_true": {"id": None}}},  # no answer text
        cf(5, "Peru", "Lima", prompt="The capital of Peru is"),  # no {} marking the subject
    ]
    _, recs = read_source(str(write_jsonl(tmp_path / "x.jsonl", records)))
    assert len(recs) == 5
    assert recs[0].problem is None
    assert recs[1].problem[0] == "empty_subject"
    assert recs[2].problem == ("duplicate_id", "id '1' already used on line 1") and recs[2].record_id == "1@line3"
    assert recs[3].problem == ("missing_field", "line 4: missing field 'requested_rewrite.target_true.str'")
    assert recs[4].problem[0] == "subject_not_in_prompt"


def test_tracing_subject_not_in_prompt(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Paris is in", "subject": "Lyon", "target_true": " France",
                                            "target_false": " Italy", "relation_id": "P17"}])
    _, [rec] = read_source(str(p))
    assert rec.problem == ("subject_not_in_prompt", "line 1: subject 'Lyon' does not occur in its prompt")


def test_pair_file_problems(tmp_path):
    base = {"clean_prompt": "The capital of France is", "corrupt_prompt": "The capital of Spain is",
            "clean_answer": " Paris", "corrupt_answer": " Madrid"}
    rows = [dict(base, id="a"), dict(base, id="b", subject="Germany"), dict(base, id="c", subject=" "),
            {k: v for k, v in dict(base, id="d").items() if k != "corrupt_answer"}, dict(base, id="e", clean_prompt=3)]
    _, recs = read_source(str(write_jsonl(tmp_path / "p.jsonl", rows)), "patchgrid")
    assert [r.problem and r.problem[0] for r in recs] == [None, "subject_not_in_prompt", "empty_subject",
                                                          "missing_field", "bad_field"]


def test_hub_name_without_network_is_a_clear_error(monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # read when they are first imported: in a session that imported them earlier, the variables alone would
    # leave them waiting on network timeouts (20 s)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceError, match="azhx/counterfact: could not load the hub data set"):
        read_source("azhx/counterfact")
