"""`patchgrid study`, `query` and `serve` as a researcher runs them: real processes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.engines import needs_vllm
from tests.support.pairs import DATA

REPO = Path(__file__).resolve().parents[2]


def cli(*args, timeout=600, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "patchgrid", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@needs_vllm
def test_study_prints_run_id_then_query_reads_it(tmp_path):
    wh = tmp_path / "w.duckdb"
    res = cli("study", "--model", "tiny-llama", "--pairs", str(DATA), "--limit", "2", "--no-require-known",
              "--sweeps", "resid,mlp_out", "--warehouse", str(wh), "--workdir", str(tmp_path / "work"),
              cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run_id = res.stdout.strip().splitlines()[-1]
    assert run_id.startswith("run-")
    assert "patched runs" in res.stderr  # the progress bar
    q = cli("query", "--warehouse", str(wh),
            f"SELECT sweep, count(*) AS n FROM effects WHERE run_id = '{run_id}' GROUP BY sweep ORDER BY sweep")
    assert q.returncode == 0, q.stderr
    lines = q.stdout.strip().splitlines()
    assert lines[0].split() == ["sweep", "n"] and lines[1].split()[0] == "mlp_out" and lines[2].split()[0] == "resid"
    assert lines[-1] == "(2 rows)"


@needs_vllm
def test_study_with_the_atp_sweep_fills_the_warehouse_and_the_report(tmp_path):
    wh = tmp_path / "w.duckdb"
    res = cli("study", "--model", "tiny-gpt2", "--pairs", str(DATA), "--limit", "3", "--no-require-known",
              "--sweeps", "atp", "--atp-kinds", "resid,attn_out,mlp_out,heads,neurons", "--verify-top", "4",
              "--verify-random", "3", "--atp-correction", "graddrop", "--warehouse", str(wh),
              "--workdir", str(tmp_path / "work"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run_id = res.stdout.strip().splitlines()[-1]
    q = cli("query", "--warehouse", str(wh),
            "SELECT site, count(DISTINCT pair_id) AS pairs, count(*) FILTER (WHERE verify = 'top') AS top, "
            "count(*) FILTER (WHERE verify = 'random') AS sampled, "
            "count(*) FILTER (WHERE effect IS NULL) AS unpatched, "
            "count(*) FILTER (WHERE estimate IS NULL OR estimate_graddrop IS NULL) AS no_estimate "
            f"FROM effects WHERE run_id = '{run_id}' AND sweep = 'atp' GROUP BY site ORDER BY site")
    assert q.returncode == 0, q.stderr
    lines = [line.split() for line in q.stdout.strip().splitlines()]
    assert [line[0] for line in lines[1:-1]] == ["attn_out", "head", "mlp_out", "neuron", "resid"]
    for site, pairs, top, sampled, unpatched, no_estimate in lines[1:-1]:
        assert (int(pairs), int(top), int(sampled), int(no_estimate)) == (3, 12, 9, 0), site
        assert int(unpatched) > 0
    rep = cli("report", "--warehouse", str(wh), "--out", str(tmp_path / "report"))
    assert rep.returncode == 0, rep.stderr[-3000:]
    html = (tmp_path / "report" / "report.html").read_text()
    assert "AtP" in html


def test_study_with_the_new_sites_and_paths_fills_the_warehouse_and_the_report(tmp_path):
    wh = tmp_path / "w.duckdb"
    res = cli("study", "--model", "tiny-qwen3", "--pairs", str(DATA), "--limit", "3", "--no-require-known",
              "--sweeps", "resid_pre,resid_mid,qkv,paths", "--path-senders", "heads,mlp_out.0",
              "--path-receivers", "logits,head.3.1", "--path-inputs", "q,v", "--path-mlps", "recomputed",
              "--warehouse", str(wh), "--workdir", str(tmp_path / "work"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run_id = res.stdout.strip().splitlines()[-1]
    q = cli("query", "--warehouse", str(wh),
            "SELECT sweep, count(DISTINCT pair_id) AS pairs, count(DISTINCT site) AS sites, "
            "count(DISTINCT receiver) AS receivers, count(*) FILTER (WHERE effect IS NULL) AS missing "
            f"FROM effects WHERE run_id = '{run_id}' GROUP BY sweep ORDER BY sweep")
    assert q.returncode == 0, q.stderr
    lines = [line.split() for line in q.stdout.strip().splitlines()][1:-1]
    # paths: senders head and mlp_out; receivers logits, q.3.1 and v.3.0 (4 heads, 2 key/value heads)
    assert lines == [["paths", "3", "2", "3", "0"], ["qkv", "3", "3", "0", "0"], ["resid_mid", "3", "1", "0", "0"],
                     ["resid_pre", "3", "1", "0", "0"]]
    params = cli("query", "--warehouse", str(wh), f"SELECT params->>'path_mlps' FROM runs WHERE run_id = '{run_id}'")
    assert "recomputed" in params.stdout
    rep = cli("report", "--warehouse", str(wh), "--out", str(tmp_path / "report"))
    assert rep.returncode == 0, rep.stderr[-3000:]
    html = (tmp_path / "report" / "report.html").read_text()
    assert "Path patching" in html and "recomputed" in html


@pytest.mark.parametrize("args, message", [
    (["--path-senders", "q.1.0"], "path sender 'q.1.0'"),
    (["--path-mlps", "half"], "invalid choice: 'half'"),
    (["--verify-top", "-2"], "--verify-top -2 must not be negative"),
    (["--atp-kinds", "heads,trace"], "unknown atp kind 'trace'"),
    (["--limit", "0"], "--limit 0 must be at least 1"),
    (["--sweeps", "resid,everything"], "unknown sweep 'everything'"),
    (["--pairs", "no/such/file.jsonl"], "--pairs no/such/file.jsonl: no such file"),
    (["--warehouse", "/no/such/dir/w.duckdb"], "folder /no/such/dir does not exist"),
    (["--model", "not-a-model"], "unknown model 'not-a-model'"),
    (["--model", "tiny-gptj", "--sweeps", "resid,resid_mid"],
     "sweep resid_mid: site resid_mid: the gptj block is parallel"),
    (["--model", "tiny-qwen3-moe", "--atp-kinds", "heads,neurons", "--sweeps", "atp"],
     "sweep atp: site neuron: the qwen3_moe MLP is a mixture of experts"),
])
def test_study_bad_arguments(tmp_path, args, message):
    base = {"--model": "tiny-llama", "--pairs": str(DATA), "--warehouse": str(tmp_path / "w.duckdb")}
    base.update(dict(zip(args[::2], args[1::2])))
    res = cli("study", *[x for kv in base.items() for x in kv], cwd=tmp_path, timeout=120)
    assert res.returncode == 2
    assert message in res.stderr.strip().splitlines()[-1] and "Traceback" not in res.stderr


def test_serve_refuses_a_bad_cron(tmp_path):
    res = cli("serve", "--cron", "every night", "--pairs", str(DATA), "--model", "tiny-llama", timeout=60)
    assert res.returncode == 2 and "--cron 'every night' is not a cron expression" in res.stderr


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
