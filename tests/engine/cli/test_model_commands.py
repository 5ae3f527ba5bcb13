"""Commands run in this process (`patchgrid.cli.main`), as a researcher runs them: `patch` and
`attention` on vLLM against the same command on hf, `pairs check` (its counts, its table, its answer
policies), `sweep` on the Hugging Face backend into a warehouse that `query` and `report` read, and causal
tracing by `sweep` on the facts the model knows alone. Commands on vLLM as processes of their own, stopped
mid-sweep: tests/process/test_stopping.py."""
from __future__ import annotations

import json

from patchgrid.metrics import METRICS
from patchgrid.pipeline.spec import default_run_id
from patchgrid.pipeline.steps import model_sha256
from patchgrid.sweeps import SweepConfig
from tests.support.engines import needs_vllm
from tests.support.pairs import cf, write_jsonl
from tests.support.processes import cli_here as run

PAIR = ["--clean", "The capital of France is", "--corrupt", "The capital of Spain is",
        "--clean-answer", " Paris", "--corrupt-answer", " Madrid"]


@needs_vllm
def test_patch_json_on_vllm_matches_hf():
    args = ["patch", "--model", "tiny-llama", *PAIR, "--site", "resid", "--json"]
    out_v, out_h = (run(*args, "--backend", backend) for backend in ("vllm", "hf"))
    assert out_v.returncode == 0, out_v.stderr
    assert out_h.returncode == 0, out_h.stderr
    v, h = json.loads(out_v.stdout), json.loads(out_h.stdout)
    assert set(v) == {"baseline", "effects"}
    assert set(v["baseline"]) == {"metric", "clean", "corrupt", "runs"} and v["baseline"]["metric"] == "logit_diff"
    n_tokens = len({e["position"] for e in v["effects"]})
    assert len(v["effects"]) == 4 * n_tokens  # every layer x every position
    e = v["effects"][0]
    assert set(e) == {"site", "layer", "position", "head", "neuron", "recovery", *METRICS}
    assert e["head"] is None and e["neuron"] is None and e["site"] == "resid"
    for a, b in zip(v["effects"], h["effects"]):
        assert (a["layer"], a["position"]) == (b["layer"], b["position"])
        for m in METRICS:
            assert abs(a[m] - b[m]) < 1e-4, m


# three capitals and a record with no subject (rejected: empty_subject)
FACTS = [("France", "Paris"), ("Germany", "Berlin"), ("Japan", "Tokyo"), ("", "x")]


def _facts(tmp_path, facts=FACTS):
    """facts.jsonl in tmp_path: a CounterFact record "The capital of {subject} is" {answer} per (subject, answer)."""
    return write_jsonl(tmp_path / "facts.jsonl", [cf(i, s, a) for i, (s, a) in enumerate(facts)])


def test_pairs_check_prints_counts_and_writes_table(tmp_path):
    import pyarrow.parquet as pq

    src = _facts(tmp_path)
    out = tmp_path / "pairs.parquet"
    res = run("pairs", "check", "--model", "smollm2-135m", "--pairs", str(src), "--out", str(out),
                  "--backend", "hf")  # require-known by default, as in a study
    assert res.returncode == 0, res.stderr
    assert "4 records, format counterfact" in res.stdout
    assert "empty_subject" in res.stdout
    table = pq.read_table(out)
    assert table.num_rows == 4
    statuses = table.column("status").to_pylist()
    assert statuses[3] == "rejected" and statuses.count("accepted") >= 2
    # each rejected pair by its id, with its reason and detail, as the table holds them
    rows = table.to_pylist()
    rejected = [r for r in rows if r["status"] == "rejected"]
    lines = res.stdout.splitlines()
    at = lines.index(f"rejected pairs (all {len(rejected)}; each with its detail in {out}):")
    assert lines[at + 1:at + 1 + len(rejected)] == [f"  {r['pair_id']}  {r['reason']}: {r['detail']}" for r in rejected]
    assert lines[at + 1 + len(rejected)] == f"wrote {out}"


def test_pairs_check_answer_policy(tmp_path):
    import pyarrow.parquet as pq

    src = _facts(tmp_path, [("France", "Paris"), ("Germany", "Berlin"), ("Nigeria", "Abuja"), ("Ghana", "Accra")])
    base = ["pairs", "check", "--model", "smollm2-135m", "--pairs", str(src), "--no-require-known"]
    out, single = tmp_path / "pairs.parquet", tmp_path / "pairs-single.parquet"
    res = run(*base, "--out", str(out))  # full by default: Abuja and Accra (two tokens each) are scored whole
    res_single = run(*base, "--out", str(single), "--answer-policy", "single")
    res_whole = run(*base, "--out", str(tmp_path / "pairs-whole.parquet"), "--answer-policy", "whole")
    assert res.returncode == 0, res.stderr
    assert "accepted" in res.stdout and "answer_multi_token" not in res.stdout
    table = pq.read_table(out)
    assert table.column("status").to_pylist() == ["accepted"] * 4
    assert [len(ids) for ids in table.column("clean_answer_ids").to_pylist()] == [1, 1, 2, 2]
    assert res_single.returncode == 0, res_single.stderr
    assert "answer_multi_token" in res_single.stdout
    assert pq.read_table(single).column("reason").to_pylist()[2:] == ["answer_multi_token"] * 2
    assert res_whole.returncode == 2 and "invalid choice: 'whole'" in res_whole.stderr


def _pairs_table():
    """pairs.parquet in the working folder, from facts.jsonl there, made without asking the model."""
    res = run("pairs", "check", "--model", "tiny-llama", "--pairs", "facts.jsonl", "--out", "pairs.parquet",
              "--no-require-known")
    assert res.returncode == 0, res.stderr


def test_sweep_loads_its_rows_into_a_warehouse_that_query_and_report_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _facts(tmp_path)
    _pairs_table()
    sweep = ["sweep", "--model", "tiny-llama", "--backend", "hf", "--pairs-table", "pairs.parquet", "--limit", "2",
             "--sweeps", "resid", "--warehouse", "results/w.duckdb", "--out", "rows/effects.parquet"]  # folders made
    # refused before any work: no warehouse, no cache, no effects file left behind
    bad = run(*sweep, "--run-id", "no spaces")
    assert bad.returncode == 2 and "--run-id 'no spaces' may hold only" in bad.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["facts.jsonl", "pairs.parquet"]
    # causal tracing runs on the facts the model knows alone: a table made without asking it has none
    unjudged = run(*sweep, "--sweeps", "resid,trace")
    assert unjudged.returncode == 2
    assert unjudged.stderr.strip().splitlines()[-1] == (
        "patchgrid: error: --pairs-table pairs.parquet: no fact in the table that the model knows alone (its top "
        "prediction the answer): nothing to trace; leave trace out of --sweeps, or take a model that knows these "
        "facts; the table's facts were not judged by the model: write it with `patchgrid pairs check` --require-known")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["facts.jsonl", "pairs.parquet"]
    res = run(*sweep)
    assert res.returncode == 0, res.stderr[-3000:]
    run_id = res.stdout.strip().splitlines()[-1].split()[1]
    assert res.stdout.strip().splitlines()[-2].startswith("2 pairs, ") and "traced facts" not in res.stdout
    assert (tmp_path / "rows" / "effects.parquet").is_file() and (tmp_path / "results" / "w.data").is_dir()
    assert res.stdout.strip().splitlines()[-1] == f"run {run_id} -> results/w.duckdb" and run_id.startswith("sweep-")
    got = run("query", "--warehouse", "results/w.duckdb", "--format", "json",
              "SELECT run_id, model, status, params FROM runs")
    assert got.returncode == 0, got.stderr
    (record,) = json.loads(got.stdout)
    params = json.loads(record["params"])
    assert (record["run_id"], record["model"], record["status"]) == (run_id, "tiny-llama", "completed")
    assert params["command"] == "sweep" and params["sweeps"] == ["resid"] and params["limit"] == 2
    assert params["pairs_table"] == str(tmp_path / "pairs.parquet")
    # its id is a study's rule (patchgrid.pipeline.spec.default_run_id) under the sweep command's prefix
    own = {k: params[k] for k in ("command", "model", "pairs_table", "limit", "backend")}
    assert run_id == default_run_id("sweep", model_sha256("tiny-llama"), own, SweepConfig(sweeps=("resid",)))
    counts = run("query", "--warehouse", "results/w.duckdb", "--format", "csv",
                 "SELECT (SELECT count(DISTINCT pair_id) FROM effects) AS swept, (SELECT count(*) FROM pairs) AS pairs,"
                 " (SELECT max(n_pairs) FROM effect_summary WHERE sweep = 'resid') AS n")
    assert counts.stdout.splitlines()[1] == "2,4,2", counts.stdout  # every row of the table; 2 pairs swept
    rep = run("report", "--warehouse", "results/w.duckdb", "--out", "rep")
    assert rep.returncode == 0, rep.stderr
    assert run_id in (tmp_path / "rep" / "report.html").read_text()
    # a rerun with the same inputs is the same run: its rows replaced, never duplicated
    again = run(*sweep)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == f"run {run_id} -> results/w.duckdb"
    twice = run("query", "--warehouse", "results/w.duckdb", "--format", "csv",
                "SELECT (SELECT count(*) FROM runs), (SELECT count(DISTINCT pair_id) FROM effects)")
    assert twice.stdout.splitlines()[1] == "1,2"
    # another dtype is another run, its dtype recorded (auto, the default, is left out of the id)
    half = run(*sweep, "--dtype", "bfloat16")
    assert half.returncode == 0, half.stderr[-3000:]
    half_id = half.stdout.strip().splitlines()[-1].split()[1]
    assert half_id == default_run_id("sweep", model_sha256("tiny-llama"), {**own, "dtype": "bfloat16"},
                                     SweepConfig(sweeps=("resid",))) != run_id
    got = run("query", "--warehouse", "results/w.duckdb", "--format", "csv",
              f"SELECT params ->> 'dtype' FROM runs WHERE run_id = '{half_id}'")
    assert got.stdout.splitlines()[1] == "bfloat16", got.stdout


def test_sweep_runs_causal_tracing_on_the_facts_the_model_knows_alone(tmp_path, monkeypatch):
    """As a study does: each kind on its population, tracing on the facts the model knows alone (partner
    or not, accepted as a pair or not), the other kinds on the accepted pairs."""
    from patchgrid.pairs import accepted_pairs, read_pairs, traced_facts
    from tests.support.pairs import DATA

    monkeypatch.chdir(tmp_path)
    # two relations' records, some of which tiny-llama knows alone, a few both ways (accepted pairs)
    records = [line for line in DATA.read_text().splitlines() if json.loads(line)["relation"] in ("plural", "opposite")]
    (tmp_path / "facts.jsonl").write_text("\n".join(records) + "\n")
    made = run("pairs", "check", "--model", "tiny-llama", "--backend", "hf", "--pairs", "facts.jsonl")  # judged
    assert made.returncode == 0, made.stderr[-3000:]
    table = read_pairs(tmp_path / "pairs.parquet")
    pairs, facts = accepted_pairs(table, 2), traced_facts(table, 2)
    accepted = {p.pair_id for p in accepted_pairs(table)}
    assert len(pairs) == 2 and facts and not {f.pair_id for f in facts} <= accepted, "the test needs other facts"
    res = run("sweep", "--model", "tiny-llama", "--backend", "hf", "--pairs-table", "pairs.parquet", "--limit", "2",
              "--sweeps", "resid,trace", "--trace-samples", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-2].startswith(f"2 pairs, {len(facts)} traced facts, ") and lines[-1].startswith("run sweep-")
    swept = json.loads(run("query", "--format", "json", "SELECT sweep, list(DISTINCT pair_id ORDER BY pair_id) AS ids "
                           "FROM effects GROUP BY ALL").stdout)
    assert {s["sweep"]: s["ids"] for s in swept} == {"resid": sorted(p.pair_id for p in pairs),
                                                     "trace": sorted(f.pair_id for f in facts)}
    (record,) = json.loads(run("query", "--format", "json", "SELECT params, (SELECT list(pair_id ORDER BY pair_id) "
                            "FROM baselines) AS baselines FROM runs").stdout)
    assert json.loads(record["params"])["traced"].startswith("facts the model knows alone")
    assert record["baselines"] == sorted(p.pair_id for p in pairs)  # tracing's facts have no baselines of their own


@needs_vllm
def test_attention_json_on_vllm_matches_hf():
    """Gemma 2's sliding windows and soft-capped scores: the weights vLLM's worker computes from its
    kernel's q and k against transformers' attention, query rows by key columns."""
    text = "The capital of France is Paris, and the capital of Germany is Berlin; the capital of Spain is"
    args = ["attention", "--model", "tiny-gemma2", "--text", text, "--layers", "0,3", "--heads", "1", "--json"]
    got = {}
    backends = ("vllm", "hf")
    for backend in backends:
        out = run(*args, "--backend", backend, "--dtype", "float32")
        assert out.returncode == 0, out.stderr
        got[backend] = json.loads(out.stdout)
    v, h = got["vllm"], got["hf"]
    assert v["tokens"] == h["tokens"] and len(v["tokens"]) > 8  # longer than the 8-token window
    assert [(p["layer"], p["head"]) for p in v["patterns"]] == [(0, 1), (3, 1)]
    n = len(v["tokens"])
    for a, b in zip(v["patterns"], h["patterns"]):
        assert len(a["weights"]) == n and all(len(row) == n for row in a["weights"])
        assert max(abs(x - y) for ra, rb in zip(a["weights"], b["weights"]) for x, y in zip(ra, rb)) < 1e-5
        assert all(abs(sum(row) - 1) < 1e-5 and not any(row[t + 1:]) for t, row in enumerate(a["weights"]))
