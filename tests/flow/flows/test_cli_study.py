"""`patchgrid study`, `query` and `report` run in this process (`patchgrid.cli.main`) against the
session's Prefect API: what a study of each kind writes to the warehouse, says in its summary and draws in
its report, and the refusal of a data set with no accepted pair; and prefect.yaml's deployments of the
study flow. The same commands as processes, their exit codes and streams: tests/process/flows/."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from patchgrid.warehouse.loader import query
from tests.support.engines import needs_vllm
from tests.support.pairs import DATA
from tests.support.paths import REPO
from tests.support.processes import cli_here


@pytest.fixture
def run(prefect_api):
    """`patchgrid ARGS` run here, against the session's Prefect API."""
    return cli_here


def test_prefect_yaml_deploys_the_study_flow_on_cron_schedules():
    from cronsim import CronSim

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    assert spec["definitions"]["schedules"]
    for dep in spec["deployments"]:
        path, name = dep["entrypoint"].split(":")
        assert (REPO / path).is_file() and name == "study"
        assert dep["work_pool"]["name"] == "patchgrid-local"
        for sched in dep["schedules"]:
            CronSim(sched["cron"], __import__("datetime").datetime(2026, 1, 1))
        assert dep["parameters"]["spec"]["pairs"] == "data/pairs/facts.jsonl"
    from patchgrid.flows.study import study

    # the flow's parameters as Prefect validates them for a deployment: every setting a StudySpec
    for dep in spec["deployments"]:
        assert set(dep["parameters"]) == set(study.parameters.properties) == {"spec"}
        checked = study.validate_parameters(dep["parameters"])["spec"]
        assert checked.sweeps == tuple(dep["parameters"]["spec"]["sweep"]["sweeps"])


def test_a_rerun_for_scripts_prints_the_summary_as_json_or_the_run_id_alone(run, tmp_path):
    """The first run's summary as text (tests/process/flows/test_cli_study.py reads it from a process), its
    rerun, every step cached, as one JSON object with --json, or the run id alone with --quiet."""
    wh = tmp_path / "w.duckdb"
    args = ("study", "--model", "tiny-llama", "--pairs", str(DATA), "--limit", "2", "--no-require-known",
            "--sweeps", "resid", "--backend", "hf", "--warehouse", str(wh), "--workdir", str(tmp_path / "work"))
    first = run(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = first.stdout.strip().splitlines()[-1]
    (read,) = query(wh, "SELECT count(*) FROM pairs")[1][0]
    (n_effects,) = query(wh, "SELECT count(*) FROM effects")[1][0]
    js = run(*args, "--json")
    assert js.returncode == 0, js.stderr[-3000:]
    summary = json.loads(js.stdout)
    assert set(summary) == {"run_id", "name", "warehouse", "model", "status", "seconds", "records", "sweeps",
                            "strongest", "strongest_edges", "circuits", "knockouts", "commands"}
    assert summary["strongest_edges"] == [] and summary["circuits"] == []  # no edges or circuit sweep
    assert summary["knockouts"] == []  # no knockout sweep
    assert summary["name"] is None  # no --name given
    assert (summary["run_id"], summary["status"], summary["records"]["read"]) == (run_id, "completed", read)
    assert summary["sweeps"] == [{"sweep": "resid", "pairs": 2, "effect_rows": n_effects, "patched_runs": n_effects}]
    assert set(summary["strongest"][0]) >= {"sweep", "cell", "metric", "n_pairs", "mean", "ci95_low", "ci95_high"}
    quiet = run(*args, "--quiet")
    assert quiet.returncode == 0 and quiet.stdout == f"{run_id}\n", quiet.stderr[-3000:]


@needs_vllm
def test_a_data_set_with_no_accepted_pair_says_why_and_loads_its_rejections(run, tmp_path):
    source = tmp_path / "bad.jsonl"
    records = [  # prompts of different token lengths, and a pair whose prompts are the same
        ("The capital of France is", "The capital of the United Kingdom of Great Britain is", " Paris", " London"),
        ("Rome is in", "The city of San Francisco is in", " Italy", " California"),
        ("The capital of Spain is", "The capital of Spain is", " Madrid", " Rome")]
    source.write_text("".join(json.dumps(dict(zip(("clean_prompt", "corrupt_prompt", "clean_answer",
                                                   "corrupt_answer"), r))) + "\n" for r in records))
    wh = tmp_path / "w.duckdb"
    # the hf backend: pairing still asks the model (require-known, the default), whose engine starts in a
    # second on hf; what the refusal says is the point here, not the engine
    res = run("study", "--model", "tiny-llama", "--pairs", str(source), "--sweeps", "resid", "--backend", "hf",
              "--warehouse", str(wh), "--workdir", str(tmp_path / "work"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"patchgrid: error: no accepted pairs in {source} (0 of 3 records accepted: "
                           "length_mismatch 2, identical_prompts 1); a clean and a corrupt prompt must be as many "
                           "tokens long"), last
    assert "the two prompts of a pair must differ" in last and ".parquet" not in last
    # the query the error names reads the failed run's rejections
    sql = re.search(r'the rejections: patchgrid query --warehouse \S+ "(.+)"$', last).group(1)
    run_id = re.search(r"run_id = '(run-[0-9a-f]+)'", sql).group(1)
    q = run("query", "--warehouse", str(wh), sql)
    assert q.returncode == 0, q.stderr
    assert [line.split()[:2] for line in q.stdout.strip().splitlines()[1:-1]] == [
        ["0", "length_mismatch"], ["1", "length_mismatch"], ["2", "identical_prompts"]]
    q = run("query", "--warehouse", str(wh), "SELECT r.status, x.reason, x.n FROM runs r JOIN rejections x "
            f"USING (run_id) WHERE run_id = '{run_id}' ORDER BY x.n DESC")
    assert q.returncode == 0, q.stderr
    assert [line.split() for line in q.stdout.strip().splitlines()[1:]] == [
        ["failed", "length_mismatch", "2"], ["failed", "identical_prompts", "1"], ["(2", "rows)"]]
    [(reason,)] = query(wh, "SELECT reason FROM runs WHERE run_id = ?", [run_id])[1]
    assert reason.startswith(f"ValueError: no accepted pairs in {source}"), reason  # the runs table's reason


@needs_vllm
def test_study_with_the_atp_sweep_fills_the_warehouse_and_the_report(run, tmp_path):
    wh = tmp_path / "w.duckdb"
    res = run("study", "--model", "tiny-gpt2", "--pairs", str(DATA), "--limit", "3", "--no-require-known",
              "--sweeps", "atp", "--atp-kinds", "resid,attn_out,mlp_out,heads,neurons", "--verify-top", "4",
              "--verify-random", "3", "--atp-correction", "graddrop", "--warehouse", str(wh),
              "--workdir", str(tmp_path / "work"))
    assert res.returncode == 0, res.stderr[-3000:]
    run_id = res.stdout.strip().splitlines()[-1]
    q = run("query", "--warehouse", str(wh),
            "SELECT site, count(DISTINCT pair_id) AS pairs, count(*) FILTER (WHERE verify = 'top') AS top, "
            "count(*) FILTER (WHERE verify = 'random') AS sampled, "
            "count(*) FILTER (WHERE effect IS NULL) AS unpatched, "
            "count(*) FILTER (WHERE estimate IS NULL OR estimate_graddrop IS NULL) AS no_estimate "
            f"FROM effects WHERE run_id = '{run_id}' AND sweep = 'atp' GROUP BY site ORDER BY site")
    assert q.returncode == 0, q.stderr
    lines = [line.split() for line in q.stdout.strip().splitlines()]
    assert [line[0] for line in lines[1:-1]] == ["attn_out", "head", "mlp_out", "neuron", "resid"]
    for site, pairs, top, sampled, unpatched, no_estimate in lines[1:-1]:
        scopes = 2 if site in ("head", "neuron") else 1  # per position, and every position at once: each its own
        assert (int(pairs), int(top), int(sampled), int(no_estimate)) == (3, 12 * scopes, 9 * scopes, 0), site
        assert int(unpatched) > 0
    rep = run("report", "--warehouse", str(wh), "--out", str(tmp_path / "report"))
    assert rep.returncode == 0, rep.stderr[-3000:]
    html = (tmp_path / "report" / "report.html").read_text()
    assert "AtP" in html


def test_study_with_the_edges_sweep_fills_the_warehouse_the_summary_and_the_report(run, tmp_path):
    """Every edge of every pair scored, the strongest and a sample patched exactly on vLLM, the
    strongest edges printed, the agreement and the matrix in the report; circuits built from the
    scores, run on vLLM, their CPR and CMD printed, their curve and diagram in the report."""
    from patchgrid.methods.graph import EdgeGraph
    from patchgrid.model.sites import shape_of

    wh = tmp_path / "w.duckdb"
    res = run("study", "--model", "tiny-llama", "--pairs", str(DATA), "--limit", "2", "--no-require-known",
              "--sweeps", "edges,circuit", "--edge-method", "eap", "--verify-top", "3", "--verify-random", "2",
              "--circuit-sizes", "10,100", "--warehouse", str(wh), "--workdir", str(tmp_path / "work"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "strongest edges (eap scores, edge_summary, on logprob_diff" in res.stdout
    assert "circuits (circuit_score, MIB's figures over 2 sizes, on logprob_diff, 2 pairs" in res.stdout
    from transformers import AutoConfig

    from patchgrid.model.models import prepare

    n_edges = len(EdgeGraph.of(shape_of(AutoConfig.from_pretrained(prepare("tiny-llama")))).edges)
    (rows,) = query(wh, "SELECT count(*), count(DISTINCT pair_id), count(verify), count(effect) FROM effects "
                        "WHERE sweep = 'edges'")[1]
    assert rows == (2 * n_edges, 2, 10, 10)
    curve = query(wh, "SELECT size, n_pairs, faithfulness FROM circuit_curve ORDER BY size")[1]
    assert [(size, n) for size, n, _ in curve] == [(0, 2), (10, 2), (100, 2)]
    assert curve[0][2] == 0 and curve[2][2] == pytest.approx(1.0)
    (summary,) = query(wh, "SELECT count(*), min(n_pairs), any_value(method) FROM edge_summary")[1]
    assert summary == (n_edges, 2, "eap")
    (agreement,) = query(wh, "SELECT n_pairs, n_top, n_random, n_verified FROM edge_agreement")[1]
    assert agreement == (2, 6, 4, 10)
    rep = run("report", "--warehouse", str(wh), "--out", str(tmp_path / "report"))
    assert rep.returncode == 0, rep.stderr[-3000:]
    page = (tmp_path / "report" / "report.html").read_text()
    assert "Edge attribution (EAP and EAP-IG scores)" in page and "Circuits and their faithfulness" in page
    assert (tmp_path / "report" / "circuit-faithfulness.png").exists()
    assert (tmp_path / "report" / "circuit-diagram.svg").exists()


def test_study_with_the_new_sites_and_paths_fills_the_warehouse_and_the_report(run, tmp_path):
    wh = tmp_path / "w.duckdb"
    res = run("study", "--model", "tiny-qwen3", "--pairs", str(DATA), "--limit", "2", "--no-require-known",
              "--sweeps", "resid_pre,resid_mid,qkv,paths", "--path-senders", "heads,mlp_out.0",
              "--path-receivers", "logits,head.3.1", "--path-inputs", "q,v", "--path-mlps", "recomputed",
              "--warehouse", str(wh), "--workdir", str(tmp_path / "work"))
    assert res.returncode == 0, res.stderr[-3000:]
    run_id = res.stdout.strip().splitlines()[-1]
    q = run("query", "--warehouse", str(wh),
            "SELECT sweep, count(DISTINCT pair_id) AS pairs, count(DISTINCT site) AS sites, "
            "count(DISTINCT receiver) AS receivers, count(*) FILTER (WHERE effect IS NULL) AS missing "
            f"FROM effects WHERE run_id = '{run_id}' GROUP BY sweep ORDER BY sweep")
    assert q.returncode == 0, q.stderr
    lines = [line.split() for line in q.stdout.strip().splitlines()][1:-1]
    # paths: senders head and mlp_out; receivers logits, q.3.1 and v.3.0 (4 heads, 2 key/value heads)
    assert lines == [["paths", "2", "2", "3", "0"], ["qkv", "2", "3", "0", "0"], ["resid_mid", "2", "1", "0", "0"],
                     ["resid_pre", "2", "1", "0", "0"]]
    params = run("query", "--warehouse", str(wh), f"SELECT params->>'path_mlps' FROM runs WHERE run_id = '{run_id}'")
    assert "recomputed" in params.stdout
    rep = run("report", "--warehouse", str(wh), "--out", str(tmp_path / "report"))
    assert rep.returncode == 0, rep.stderr[-3000:]
    html = (tmp_path / "report" / "report.html").read_text()
    assert "Path patching" in html and "recomputed" in html

