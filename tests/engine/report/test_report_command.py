"""`patchgrid report` as a researcher runs it, in this process (`patchgrid.cli.main`), on a real sweep
of tiny-llama (hf backend, two pairs, by `pairs check` and `sweep`) and on a run that failed after loading
its records: by default the latest completed run; a failed run's page says why it ended and what it
loaded; every figure as PNG, SVG and PDF, linked from the page; a cell's pair count in its hover text,
"1 pair" where one; a report written over another replaces its files and says which run it drew. The command
as a process of its own: tests/process/flows/test_cli_study.py."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta

import pytest

from patchgrid.pairs import read_pairs
from patchgrid.report.page import WRITTEN
from patchgrid.warehouse.loader import finish_run, load_run, query, start_run
from tests.support.pairs import DATA
from tests.support.processes import cli_here as cli
from tests.support.processes import one_line_error

REASON = "ValueError: no accepted pairs in facts.jsonl (a failure the test wrote)"


def load_failed_run(wh, pairs, run_id):
    """A run that stopped after loading its records, as the study flow records one (flows/study.py:
    its pairs table loaded with status failed, then the run finished failed with its reason)."""
    now = datetime.now()
    start_run(wh, {"run_id": run_id, "model": "tiny-llama", "params": {"sweeps": ["resid"]}, "started": now})
    load_run(wh, run_id, read_pairs(pairs), [], [], finished=now + timedelta(seconds=1), status="failed")
    finish_run(wh, run_id, "failed", finished=now + timedelta(seconds=2), reason=REASON)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A warehouse with a sweep of two pairs (resid) and, started after it, a failed run."""
    tmp = tmp_path_factory.mktemp("report-cli")
    # the shipped facts' first records (interleaved by relation): enough for two pairs of two relations
    (tmp / "facts.jsonl").write_text("".join(DATA.read_text().splitlines(keepends=True)[:40]))
    res = cli("pairs", "check", "--model", "tiny-llama", "--pairs", "facts.jsonl", "--no-require-known", "--backend",
              "hf", "--out", "pairs.parquet", cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli("sweep", "--model", "tiny-llama", "--backend", "hf", "--pairs-table", "pairs.parquet", "--limit", "2",
              "--sweeps", "resid", "--warehouse", "w.duckdb", "--out", "rows/effects.parquet", cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    completed = res.stdout.strip().splitlines()[-1].split()[1]
    load_failed_run(tmp / "w.duckdb", tmp / "pairs.parquet", "run-failed")
    return tmp, completed


def test_the_default_is_the_latest_completed_run_and_help_says_so(study):
    tmp, completed = study
    assert query(tmp / "w.duckdb", "SELECT run_id FROM runs ORDER BY started DESC LIMIT 1")[1] == [("run-failed",)]
    res = cli("report", "--warehouse", "w.duckdb", "--out", "rep", cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    text = (tmp / "rep" / "report.html").read_text()
    assert f"<h1>patchgrid study {completed}</h1>" in text and "run-failed" not in text
    assert "<p class='run-ended'" not in text and "<figure" in text
    helped = cli("report", "--help", cwd=tmp)
    assert "latest completed run" in " ".join(helped.stdout.split())


def test_every_figure_as_png_svg_and_pdf_linked_from_the_page(study):
    tmp, _ = study
    out = tmp / "rep"
    if not (out / "report.html").is_file():
        assert cli("report", "--warehouse", "w.duckdb", "--out", "rep", cwd=tmp).returncode == 0
    text = (out / "report.html").read_text()
    stems = re.findall(r"data-png='([^']+)\.png'", text)
    assert stems and len(stems) == text.count("<figure")
    for stem in stems:
        assert (out / f"{stem}.png").read_bytes()[:4] == b"\x89PNG", stem
        assert (out / f"{stem}.pdf").read_bytes()[:5] == b"%PDF-", stem
        assert ET.parse(out / f"{stem}.svg").getroot().tag == "{http://www.w3.org/2000/svg}svg", stem
        assert all(f"<a href='{stem}.{fmt}'>" in text for fmt in ("png", "svg", "pdf")), stem
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["report.html", WRITTEN] + [f"{stem}.{fmt}" for stem in stems for fmt in ("png", "svg", "pdf")])
    # two pairs, one per relation: each cell's count in its hover text, "1 pair" in the multiples
    assert "2 pairs</title>" in text
    multiples = text[text.index("<h2>By relation"):]
    titles = re.findall(r"<b>([^<]+ \(1 pair, logprob_diff\))</b>", multiples)
    assert len(titles) == multiples.count("<figure") >= 2 and "1 pairs" not in text
    assert "1 pair</title>" in multiples and multiples.count('class="few"') > 0
    assert "Cells averaged over fewer than 5 pairs are faded and marked with a dot" in multiples


def test_a_report_written_over_another_replaces_its_files_and_names_its_run(study):
    tmp, completed = study
    out = tmp / "again"
    out.mkdir()
    (out / "notes.txt").write_text("the researcher's own")
    first = cli("report", "--warehouse", "w.duckdb", "--out", "again", cwd=tmp)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.strip() == f"report of run {completed}: again/report.html"
    assert any(p.suffix == ".png" for p in out.iterdir())
    second = cli("report", "--warehouse", "w.duckdb", "--run", "run-failed", "--out", "again", cwd=tmp)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.strip() == "report of run run-failed: again/report.html"
    # the failed run has no figure: none of the first run's is left beside its page; the folder's own file stays
    assert sorted(p.name for p in out.iterdir()) == sorted(["report.html", WRITTEN, "notes.txt"])


def test_a_failed_run_says_why_and_what_it_loaded(study):
    tmp, _ = study
    res = cli("report", "--warehouse", "w.duckdb", "--run", "run-failed", "--out", "failed", cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    text = (tmp / "failed" / "report.html").read_text()
    (counts,) = query(tmp / "w.duckdb", "SELECT count(*), count(*) FILTER (WHERE status = 'accepted'), "
                                        "count(*) FILTER (WHERE status = 'rejected') FROM pairs "
                                        "WHERE run_id = 'run-failed'")[1]
    assert counts[2] > 0
    box = text[text.index("<p class='run-ended'"):]
    box = box[:box.index("</p>")]
    assert f"This run failed: {REASON}" in box
    assert (f"What it loaded into the warehouse: {counts[0]} records ({counts[1]} pairs accepted, {counts[2]} "
            f"records rejected: by reason in the table below), 0 pairs swept, 0 effect rows; so there is no figure "
            f"to draw.") in box
    assert "<figure" not in text
    reasons = query(tmp / "w.duckdb", "SELECT reason, n FROM rejections WHERE run_id = 'run-failed'")[1]
    assert reasons and all(f"<tr><td>{reason}</td><td>{n}</td></tr>" in text for reason, n in reasons)


def test_a_warehouse_without_a_completed_run_is_one_line_naming_its_runs(tmp_path, study):
    tmp, _ = study
    wh = tmp_path / "w.duckdb"
    load_failed_run(wh, tmp / "pairs.parquet", "run-only")
    one_line_error(cli("report", "--warehouse", str(wh), "--out", "rep", cwd=tmp_path),
                   f"warehouse {wh} has no completed run (its runs: 1 failed (latest run-only)); --run RUN_ID "
                   f"reports any run")
    assert not (tmp_path / "rep").exists()
