"""A catalogue of bad inputs, each refused by the command line before any work starts: exit 2 and
one line naming the problem, no traceback, nothing written, no model's own code run. Run in this
process (`patchgrid.cli.main`); that a command run as a process exits with the same code and line is
shown once, in tests/process/cli/test_refusal_in_a_process.py."""
from __future__ import annotations

import json

import duckdb
import pytest

from patchgrid.cli import main
from patchgrid.warehouse.loader import SCHEMA_VERSION, ensure
from tests.support.pairs import DATA


def refused(args, capsys) -> str:
    """`patchgrid ARGS` run here: refused with exit 2 and one error line; that line."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse's own refusals (an invalid choice)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("patchgrid") and ": error: " in last, err
    return last


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


def _broken_pairs(tmp):
    (tmp / "facts.jsonl").write_text('{"case_id": 0}\n{broken\n')
    return {"--pairs": str(tmp / "facts.jsonl")}


STUDY = [
    ("limit zero", {"--limit": "0"}, "--limit 0 must be at least 1"),
    ("trace samples zero", {"--trace-samples": "0"}, "--trace-samples 0 must be at least 1"),
    ("unknown sweep", {"--sweeps": "resid,bogus"}, "unknown sweep 'bogus'"),
    ("missing pairs file", {"--pairs": "missing.jsonl"}, "--pairs missing.jsonl: no such file"),
    ("pairs file with a broken line", _broken_pairs, "facts.jsonl line 2: not valid JSON"),
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
    ("path sender not a sender", {"--path-senders": "q.1.0"}, "path sender 'q.1.0'"),
    ("path mlps not a choice", {"--path-mlps": "half"}, "invalid choice: 'half'"),
    ("verify top negative", {"--verify-top": "-2"}, "--verify-top -2 must not be negative"),
    ("atp kind not screenable", {"--atp-kinds": "heads,trace"}, "unknown atp kind 'trace'"),
    ("site the family lacks", {"--model": "tiny-gptj", "--sweeps": "resid,resid_mid"},
     "sweep resid_mid: site resid_mid: the gptj block is parallel"),
    ("neurons of a mixture of experts",
     {"--model": "tiny-qwen3-moe", "--atp-kinds": "heads,neurons", "--sweeps": "atp"},
     "sweep atp: site neuron: the qwen3_moe MLP is a mixture of experts"),
]


@pytest.mark.parametrize("name, change, message", STUDY, ids=[s[0] for s in STUDY])
def test_study_refuses(tmp_path, monkeypatch, capsys, name, change, message):
    monkeypatch.chdir(tmp_path)
    args = {"--model": "tiny-llama", "--pairs": str(DATA), "--warehouse": str(tmp_path / "w.duckdb"),
            "--workdir": str(tmp_path / "work")}
    args.update(change(tmp_path) if callable(change) else change)
    assert message in refused(["study", *[x for kv in args.items() for x in kv]], capsys)
    assert not (tmp_path / "ran").exists(), "a model's own code ran"
    assert not (tmp_path / "work").exists(), "the study started despite the bad input"


PAIR_FILES = [
    ("malformed line", b'{"case_id": 1}\n{"case_id": 2,,}\n', "bad.jsonl line 2: not valid JSON"),
    ("not UTF-8", '{"subject": "Caf\u00e9"}\n'.encode("latin-1"), "bad.jsonl line 1: not UTF-8 text"),
    ("empty", b"", "bad.jsonl: holds no records"),
    ("unknown fields", b'{"question": "?", "reply": "!"}\n', "unknown format"),
]


@pytest.mark.parametrize("name, content, message", PAIR_FILES, ids=[p[0] for p in PAIR_FILES])
def test_pairs_check_refuses(tmp_path, capsys, name, content, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    assert message in refused(["pairs", "check", "--model", "tiny-llama", "--pairs", tmp_path / "bad.jsonl",
                               "--out", tmp_path / "o.parquet"], capsys)
    assert not (tmp_path / "o.parquet").exists()


def test_query_report_and_sweep_refuse(tmp_path, capsys):
    assert "does not exist" in refused(["query", "--warehouse", tmp_path / "none.duckdb", "SELECT 1"], capsys)
    ensure(tmp_path / "w.duckdb")
    assert "query failed" in refused(["query", "--warehouse", tmp_path / "w.duckdb", "SELEC oops"], capsys)
    assert "run 'nope' is not in the warehouse" in refused(
        ["report", "--warehouse", tmp_path / "w.duckdb", "--run", "nope", "--out", tmp_path / "r"], capsys)
    assert not (tmp_path / "r").exists()
    assert "no such file" in refused(["sweep", "--pairs-table", tmp_path / "none.parquet"], capsys)


def test_serve_refuses_a_bad_cron_and_a_limit_below_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert "--cron 'every night' is not a cron expression" in refused(
        ["serve", "--cron", "every night", "--pairs", DATA, "--model", "tiny-llama"], capsys)
    assert "--concurrency-limit 0: at least 1 run must be allowed at once" in refused(
        ["serve", "--cron", "* * * * *", "--model", "tiny-llama", "--concurrency-limit", "0"], capsys)
    assert list(tmp_path.iterdir()) == []


PAIR = {"--clean": "The capital of France is", "--corrupt": "The capital of Spain is",
        "--clean-answer": " Paris", "--corrupt-answer": " Madrid"}

# refused while the typed pair and the settings are checked, before an engine starts (the refusals
# that need the model's shape, after it starts, are in tests/engine/cli/test_commands_on_hf.py)
ONE_PAIR = [
    ("patch", "empty answer", {"--clean-answer": " ", "--corrupt-answer": " Madrid"}, "--clean-answer ' ' is empty"),
    ("patch", "same answers", {"--clean-answer": " Paris", "--corrupt-answer": " Paris"},
     "are the same tokens [' Paris']"),
    ("patch", "prompts of different lengths", {"--corrupt": "The capital of the United Kingdom is"},
     "tokenize to different lengths"),
    ("patch", "position out of range", {"--position": "99"}, "--position 99 is out of range"),
    ("patch", "position not a number", {"--position": "x"}, "--position 'x' is not a position"),
    ("patch", "unknown model", {"--model": "no-such-model"}, "unknown model 'no-such-model'"),
    ("paths", "path sender without a head", {"--path-senders": "head.1"}, "path sender 'head.1'"),
    ("paths", "path input not q, k or v", {"--path-inputs": "q,z"}, "path input 'z'"),
]


@pytest.mark.parametrize("command, name, change, message", ONE_PAIR, ids=[f"{c[0]}: {c[1]}" for c in ONE_PAIR])
def test_patch_and_paths_refuse(command, name, change, message, capsys):
    args = {"--model": "tiny-llama", **PAIR, "--backend": "hf", **change}
    if command == "patch":
        args["--site"] = "resid"
    last = refused([command, *[x for kv in args.items() for x in kv]], capsys)
    assert last.startswith("patchgrid: error:") and message in last


def test_attention_refuses_layers_that_are_not_numbers(capsys):
    last = refused(["attention", "--model", "tiny-llama", "--text", "The capital of France is", "--backend", "hf",
                    "--layers", "x"], capsys)
    assert last.startswith("patchgrid: error:") and "--layers or --heads 'x' is not a number" in last
