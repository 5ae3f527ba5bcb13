"""What the commands write, as a researcher runs them (real files; the commands in this process,
`patchgrid.cli.main`): `query` in every format and into a file, missing output folders made, and a failed
command leaving no file it made. The commands as processes of their own: tests/process/."""
from __future__ import annotations

import csv
import io
import json

import pyarrow.parquet as pq
import pytest

from patchgrid.pairs import to_table as pairs_table
from patchgrid.rows.effects import write_effects
from patchgrid.warehouse.loader import load_run, start_run
from tests.support.effect_rows import baseline, make_pair, row
from tests.support.processes import cli_here as cli
from tests.support.processes import one_line_error

ROLES = ["subject_first", "subject_last", "last"]
SQL = "SELECT run_id, layer, position_role, n_pairs, mean_recovery FROM effect_summary " \
      "WHERE metric = 'logit_diff' ORDER BY layer, position_role"





def a_run(tmp_path, wh, run_id="run-q"):
    """A completed run of two pairs, three layers, loaded as a study loads it (no engine)."""
    pairs, rows = [], []
    for i, r in enumerate((0.25, 0.75)):
        pid = f"p{i}"
        pairs.append({"pair_id": pid, "relation": "capital", "status": "accepted", "clean_prompt": "a b c",
                      "corrupt_prompt": "a x c", "clean_answer": " y", "corrupt_answer": " z", "subject": "b",
                      "subject_start": 1, "subject_end": 2, "roles": ROLES, "clean_ids": [1, 2, 3],
                      "corrupt_ids": [1, 9, 3], "clean_answer_id": 7, "corrupt_answer_id": 8})
        key = make_pair(pid, ROLES, "capital", subject=(1, 2))
        rows += [row(key, r, layer=layer, position=pos) for layer in range(3) for pos in range(3)]
    effects = write_effects(rows, tmp_path / "effects-in.parquet")
    start_run(wh, {"run_id": run_id, "model": "m", "params": {"sweeps": ["resid"]}})
    load_run(wh, run_id, pairs_table(pairs), [baseline(p["pair_id"]) for p in pairs], [effects])
    return run_id


@pytest.fixture
def warehouse(tmp_path):
    wh = tmp_path / "w.duckdb"
    a_run(tmp_path, wh)
    return wh


def test_query_prints_a_table_by_default_and_csv_and_json_on_request(tmp_path, warehouse):
    table = cli("query", "--warehouse", str(warehouse), SQL, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split() == ["run_id", "layer", "position_role", "n_pairs", "mean_recovery"]
    assert table.stdout.strip().endswith("(9 rows)")
    as_csv = cli("query", "--warehouse", str(warehouse), "--format", "csv", SQL, cwd=tmp_path)
    assert as_csv.returncode == 0, as_csv.stderr
    got = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert len(got) == 9 and got[0]["run_id"] == "run-q" and got[0]["n_pairs"] == "2"
    assert float(got[0]["mean_recovery"]) == pytest.approx(0.5, abs=1e-5)
    as_json = cli("query", "--warehouse", str(warehouse), "--format", "json", SQL, cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    records = json.loads(as_json.stdout)
    assert [r["layer"] for r in records] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert records[0]["mean_recovery"] == pytest.approx(0.5, abs=1e-5)
    # NaN is not JSON: it comes as null; timestamps as text
    odd = cli("query", "--warehouse", str(warehouse), "--format", "json",
              "SELECT 'nan'::DOUBLE AS x, TIMESTAMP '2026-01-02 03:04:05' AS t", cwd=tmp_path)
    assert json.loads(odd.stdout) == [{"x": None, "t": "2026-01-02 03:04:05"}]


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet", "table"])
def test_query_writes_a_file_in_a_folder_it_makes(tmp_path, warehouse, fmt):
    out = tmp_path / "exports" / "deep" / f"summary.{fmt}"
    res = cli("query", "--warehouse", str(warehouse), "--format", fmt, "--out", str(out), SQL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and f"9 rows -> {out}" in res.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary file left beside it
    if fmt == "parquet":  # DuckDB's own column types, not ones guessed from the values
        table = pq.read_table(out)
        assert table.num_rows == 9 and str(table.schema.field("n_pairs").type) == "int64"
        assert table.column("run_id").to_pylist() == ["run-q"] * 9
    elif fmt == "csv":
        assert len(list(csv.DictReader(out.open()))) == 9
    elif fmt == "json":
        assert len(json.loads(out.read_text())) == 9
    else:
        assert out.read_text().strip().endswith("(9 rows)")


def test_parquet_needs_out_and_a_failed_query_writes_nothing(tmp_path, warehouse):
    one_line_error(cli("query", "--warehouse", str(warehouse), "--format", "parquet", SQL, cwd=tmp_path),
                   "--format parquet needs --out FILE")
    for fmt in ("parquet", "csv"):
        one_line_error(cli("query", "--warehouse", str(warehouse), "--format", fmt, "--out",
                           str(tmp_path / "new" / f"x.{fmt}"), "SELECT nope FROM runs", cwd=tmp_path), "query failed")
    # the sandbox is as it was: a query still cannot write a file itself
    one_line_error(cli("query", "--warehouse", str(warehouse), "--format", "csv", "--out", str(tmp_path / "new" / "c"),
                       f"COPY runs TO '{tmp_path / 'copied.csv'}'", cwd=tmp_path), "query refused")
    assert not (tmp_path / "new").exists() and not (tmp_path / "copied.csv").exists()
    # an existing file is replaced only by a whole new one
    out = tmp_path / "kept.csv"
    out.write_text("earlier\n")
    one_line_error(cli("query", "--warehouse", str(warehouse), "--format", "csv", "--out", str(out), "SELEC",
                       cwd=tmp_path), "query failed")
    assert out.read_text() == "earlier\n"


def test_report_makes_its_missing_folder_and_a_failed_one_leaves_none(tmp_path, warehouse):
    out = tmp_path / "reports" / "deep"
    res = cli("report", "--warehouse", str(warehouse), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (out / "report.html").is_file()
    one_line_error(cli("report", "--warehouse", str(warehouse), "--run", "nope", "--out",
                       str(tmp_path / "never" / "r"), cwd=tmp_path), "run 'nope' is not in the warehouse")
    one_line_error(cli("report", "--warehouse", str(tmp_path / "none.duckdb"), "--out", str(tmp_path / "r2"),
                       cwd=tmp_path), "does not exist")
    assert not (tmp_path / "never").exists() and not (tmp_path / "r2").exists()
    # a folder that was there before stays, whatever fails
    one_line_error(cli("report", "--warehouse", str(warehouse), "--run", "nope", "--out", str(out), cwd=tmp_path),
                   "run 'nope'")
    assert (out / "report.html").is_file()


@pytest.mark.parametrize("command", [
    ["study", "--model", "tiny-lama"],
    ["study", "--model", "tiny-llama", "--sweeps", "resid,bogus"],
    ["serve", "--model", "tiny-lama", "--cron", "0 3 * * *"],
])
def test_a_refused_command_leaves_no_warehouse(tmp_path, command):
    res = cli(*command, "--warehouse", "out/w.duckdb", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    res = cli(*command, cwd=tmp_path)  # the default warehouse, in the current folder
    assert res.returncode == 2, res.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_misspelt_view_keeps_duckdbs_hint(tmp_path, warehouse):
    """DuckDB's cause and hint survive to the command's one line (warehouse.loader._with_hints)."""
    res = cli("query", "--warehouse", str(warehouse), "SELECT * FROM effect_sumary", cwd=tmp_path)
    one_line_error(res, 'Table with name effect_sumary does not exist!; Did you mean "effect_summary"?')


def test_pairs_check_lists_the_first_rejected_pairs_and_where_the_rest_are(tmp_path):
    """Twelve facts of twelve relations: none has a partner to swap subjects with. The tokenizer alone
    judges them (--no-require-known): the first ten are listed by id, reason and detail."""
    from patchgrid.cli.data import SHOWN_REJECTIONS
    from tests.support.pairs import cf, write_jsonl

    write_jsonl(tmp_path / "facts.jsonl", [cf(i, f"Country{i}", "Paris", relation=f"P{i}") for i in range(12)])
    res = cli("pairs", "check", "--model", "tiny-llama", "--pairs", "facts.jsonl", "--no-require-known",
              "--out", "pairs.parquet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    at = lines.index(f"rejected pairs (the first {SHOWN_REJECTIONS} of 12; each with its detail in pairs.parquet):")
    listed = lines[at + 1:at + 1 + SHOWN_REJECTIONS]
    assert all(" no_partner: " in line for line in listed), listed
    assert lines[at + 1 + SHOWN_REJECTIONS] == "wrote pairs.parquet"
