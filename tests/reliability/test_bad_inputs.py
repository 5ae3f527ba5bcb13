"""A catalogue of bad inputs: each gives one clear line naming the problem and a non-zero exit."""
from __future__ import annotations

import json
import subprocess
import sys

import duckdb
import pytest

from patchgrid.warehouse.loader import SCHEMA_VERSION, ensure
from tests.support.pairs import DATA


def _no_config(tmp):
    (tmp / "m").mkdir()
    return {"--model": str(tmp / "m")}


def _file_model(tmp):
    (tmp / "weights.bin").write_bytes(b"x")
    return {"--model": str(tmp / "weights.bin")}


def _remote_code(tmp):
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text(json.dumps({"model_type": "mine",
                                                      "auto_map": {"AutoConfig": "mine.MyConfig"}}))
    (tmp / "m" / "mine.py").write_text(f"open({str(tmp / 'ran')!r}, 'w').write('remote code ran')\n")
    return {"--model": str(tmp / "m")}


def _not_duckdb(tmp):
    (tmp / "w.duckdb").write_text("just some text, not a database")
    return {"--warehouse": str(tmp / "w.duckdb")}


def _newer_schema(tmp):
    ensure(tmp / "w.duckdb").version_file.write_text(f'{{"schema": {SCHEMA_VERSION + 5}}}')
    return {"--warehouse": str(tmp / "w.duckdb")}


def _read_only(tmp):
    ensure(tmp / "w.duckdb")
    (tmp / "w.duckdb").chmod(0o444)
    return {"--warehouse": str(tmp / "w.duckdb")}


def _foreign_duckdb(tmp):
    duckdb.connect(str(tmp / "w.duckdb")).execute("CREATE TABLE sales (x INT)").close()
    return {"--warehouse": str(tmp / "w.duckdb")}


def _corrupted(tmp):
    ensure(tmp / "w.duckdb")
    data = bytearray((tmp / "w.duckdb").read_bytes())
    for i in range(4096, len(data), 7):  # scribble over everything past the headers
        data[i] = (data[i] * 31 + 17) % 256
    (tmp / "w.duckdb").write_bytes(bytes(data))
    return {"--warehouse": str(tmp / "w.duckdb")}


STUDY = [
    ("limit zero", {"--limit": "0"}, "--limit 0 must be at least 1"),
    ("trace samples zero", {"--trace-samples": "0"}, "--trace-samples 0 must be at least 1"),
    ("unknown sweep", {"--sweeps": "resid,bogus"}, "unknown sweep 'bogus'"),
    ("missing pairs file", {"--pairs": "missing.jsonl"}, "--pairs missing.jsonl: no such file"),
    ("warehouse under a file", {"--warehouse": "/dev/null/w.duckdb"}, "/dev/null is a file, not a folder"),
    ("unknown model name", {"--model": "gpt-17"}, "unknown model 'gpt-17'"),
    ("model folder without config", _no_config, "has no config.json"),
    ("model path is a file", _file_model, "is a file, not a model folder"),
    ("model that needs remote code", _remote_code, "patchgrid does not run code that comes with a model"),
    ("warehouse not DuckDB", _not_duckdb, "is not a DuckDB file"),
    ("warehouse from a newer schema", _newer_schema, f"schema v{SCHEMA_VERSION + 5}"),
    ("warehouse read-only", _read_only, "is read-only"),
    ("DuckDB file that is not a warehouse", _foreign_duckdb, "not a patchgrid warehouse"),
    ("warehouse corrupted", _corrupted, "cannot be opened"),
]


def run(args, cwd):
    return subprocess.run([sys.executable, "-m", "patchgrid", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=180)


def assert_one_clear_line(res, message):
    assert res.returncode != 0
    err = res.stderr.strip().splitlines()
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert err and err[-1].startswith("patchgrid: error:"), res.stderr[-2000:]
    assert message in err[-1], err[-1]


@pytest.mark.parametrize("name, change, message", STUDY, ids=[s[0] for s in STUDY])
def test_study_refuses(tmp_path, name, change, message):
    args = {"--model": "tiny-llama", "--pairs": str(DATA), "--warehouse": str(tmp_path / "w.duckdb"),
            "--workdir": str(tmp_path / "work")}
    args.update(change(tmp_path) if callable(change) else change)
    res = run(["study", *[x for kv in args.items() for x in kv]], tmp_path)
    assert_one_clear_line(res, message)
    assert not (tmp_path / "ran").exists(), "a model's own code ran"
    assert not (tmp_path / "work").exists(), "the study started despite the bad input"


PAIR_FILES = [
    ("malformed line", b'{"case_id": 1}\n{"case_id": 2,,}\n', "bad.jsonl line 2: not valid JSON"),
    ("not UTF-8", '{"subject": "Caf\u00e9"}\n'.encode("latin-1"), "bad.jsonl line 1: not UTF-8 text"),
    ("empty", b"", "bad.jsonl: holds no records"),
    ("unknown fields", b'{"question": "?", "reply": "!"}\n', "unknown format"),
]


@pytest.mark.parametrize("name, content, message", PAIR_FILES, ids=[p[0] for p in PAIR_FILES])
def test_pairs_check_refuses(tmp_path, name, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    res = run(["pairs", "check", "--model", "tiny-llama", "--pairs", str(tmp_path / "bad.jsonl"), "--out",
               str(tmp_path / "o.parquet")], tmp_path)
    assert_one_clear_line(res, message)


def test_query_and_report_refuse(tmp_path):
    assert_one_clear_line(run(["query", "--warehouse", str(tmp_path / "none.duckdb"), "SELECT 1"], tmp_path),
                          "does not exist")
    ensure(tmp_path / "w.duckdb")
    assert_one_clear_line(run(["query", "--warehouse", str(tmp_path / "w.duckdb"), "SELEC oops"], tmp_path),
                          "query failed")
    assert_one_clear_line(run(["report", "--warehouse", str(tmp_path / "w.duckdb"), "--run", "nope", "--out",
                               str(tmp_path / "r")], tmp_path), "run 'nope' is not in the warehouse")
    assert_one_clear_line(run(["sweep", "--pairs-table", str(tmp_path / "none.parquet")], tmp_path), "no such file")


def test_study_refuses_a_broken_pairs_file_before_it_starts(tmp_path):
    """The data set is read before the flow starts: one line naming file and line, no run begun."""
    bad = tmp_path / "facts.jsonl"
    bad.write_text('{"case_id": 0}\n{broken\n')
    res = run(["study", "--model", "tiny-llama", "--pairs", str(bad), "--warehouse", str(tmp_path / "w.duckdb"),
               "--workdir", str(tmp_path / "work")], tmp_path)
    assert_one_clear_line(res, "facts.jsonl line 2: not valid JSON")
    assert not (tmp_path / "work").exists() and not (tmp_path / "w.duckdb").exists()
