"""The live dashboard: its reads (patchgrid/dashboard/data.py) on a small warehouse built through the
loader, `patchgrid dashboard` refusing a missing warehouse, and the page in headless Chromium showing
a run's heatmap, then a second run loaded while it is open, without a restart."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone

import pytest

from patchgrid.dashboard import data
from patchgrid.pairs import to_table
from patchgrid.warehouse.loader import WarehouseError, load_run, start_run
from tests.support.effect_rows import CLEAN, CORRUPT, baseline, make_pair, row, shifted, write_and_read_back
from tests.support.prefect_server import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ROLES = ("subject_last", "further", "last")
N_LAYERS, N_HEADS = 3, 2
RELATIONS = ("capital", "currency")


def now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)  # rows.RUN's started: a naive UTC timestamp


def recovery(layer: int, role: str, i: int) -> float:
    """Pair i's recovery at a cell: the last token matters late, the subject early; pairs differ."""
    base = {"subject_last": 1 - layer / N_LAYERS, "further": 0.1, "last": layer / (N_LAYERS - 1)}[role]
    return round(base + (i - 1.5) / 10, 4)


def load(wh, run_id: str, n_pairs: int = 4) -> None:
    """A run of `n_pairs` pairs (relations alternating) with resid (layer x role) and heads rows."""
    pairs, baselines, rows = [], [], []
    for i in range(n_pairs):
        pid, relation = f"{run_id}-p{i}", RELATIONS[i % 2]
        pairs.append({"pair_id": pid, "relation": relation, "status": "accepted", "clean_prompt": f"c{i}",
                      "corrupt_prompt": f"x{i}", "roles": list(ROLES), "subject_start": 0, "subject_end": 1})
        clean = shifted(CLEAN, logit_diff=2.0 + i / 4)
        baselines.append(baseline(pid, clean, CORRUPT))
        pair = make_pair(pid, ROLES, relation)
        for layer in range(N_LAYERS):
            rows += [row(pair, recovery(layer, role, i), layer=layer, position=pos, clean=clean)
                     for pos, role in enumerate(ROLES)]
            rows += [row(pair, 0.2 * head, sweep="heads", site="head", layer=layer, head=head, clean=clean)
                     for head in range(N_HEADS)]
    effects, _ = write_and_read_back(rows, wh.parent / f"{run_id}-effects.parquet")
    start_run(wh, {"run_id": run_id, "model": "synthetic-model", "started": now(),
                   "params": {"sweeps": ["resid", "heads"], "metric": "logit_diff"}})
    load_run(wh, run_id, to_table(pairs), baselines, [effects])


@pytest.fixture
def warehouse(tmp_path):
    wh = tmp_path / "w.duckdb"
    load(wh, "run-one")
    return wh


def test_runs_latest_first_and_their_signature_changes_when_a_run_lands(warehouse):
    first = data.runs(warehouse)
    assert [(r["run_id"], r["status"], r["n_accepted"]) for r in first] == [("run-one", "completed", 4)]
    load(warehouse, "run-two", n_pairs=2)
    second = data.runs(warehouse)
    assert [r["run_id"] for r in second] == ["run-two", "run-one"]
    assert data.runs_signature(second) != data.runs_signature(first)
    assert data.runs_signature(data.runs(warehouse)) == data.runs_signature(second)


def test_filters_name_the_runs_sweeps_metrics_and_relations(warehouse):
    f = data.filters(warehouse, "run-one")
    assert f["sweeps"] == ["heads", "resid"] and f["directions"] == ["denoise"]
    assert "logit_diff" in f["metrics"] and "kl" in f["metrics"]
    assert f["relations"] == list(RELATIONS)


def test_cells_carry_means_intervals_and_pair_counts(warehouse):
    cells = data.cells(warehouse, "run-one", "resid", "denoise", "logit_diff")
    assert len(cells) == N_LAYERS * len(ROLES)
    assert list(dict.fromkeys(c["column"] for c in cells)) == list(ROLES)  # the prompt's order
    by_cell = {(c["layer"], c["column"]): c for c in cells}
    last = by_cell[(2, "last")]
    expected = sum(recovery(2, "last", i) for i in range(4)) / 4
    assert last["n_pairs"] == 4 and last["mean_recovery"] == pytest.approx(expected, abs=1e-4)
    assert last["ci95_low"] < last["mean_recovery"] < last["ci95_high"]
    assert data.value_column(cells) == "mean_recovery"
    heads = data.cells(warehouse, "run-one", "heads", "denoise", "logit_diff")
    assert sorted({c["column"] for c in heads}) == ["all · head 0", "all · head 1"]


def test_a_relation_filter_reads_that_relations_pairs_only(warehouse):
    cells = data.cells(warehouse, "run-one", "resid", "denoise", "logit_diff", relation="currency")
    cell = next(c for c in cells if (c["layer"], c["column"]) == (0, "subject_last"))
    assert cell["n_pairs"] == 2 and cell["relation"] == "currency"  # pairs 1 and 3
    expected = (recovery(0, "subject_last", 1) + recovery(0, "subject_last", 3)) / 2
    assert cell["mean_recovery"] == pytest.approx(expected, abs=1e-4)
    assert data.pair_ids(warehouse, "run-one", "resid", "currency") == ["run-one-p1", "run-one-p3"]


def test_one_pairs_grid_and_the_pairs_of_one_cell(warehouse):
    grid = data.pair_grid(warehouse, "run-one", "run-one-p2", "resid", "denoise", "logit_diff")
    assert {(g["layer"], g["column"]): g["recovery"] for g in grid} == pytest.approx(
        {(layer, role): recovery(layer, role, 2) for layer in range(N_LAYERS) for role in ROLES}, abs=1e-4)
    at = data.cell_pairs(warehouse, "run-one", "resid", "denoise", "logit_diff", {"layer": 2, "column": "last"})
    assert [p["pair_id"] for p in at] == [f"run-one-p{i}" for i in (3, 2, 1, 0)]  # the largest |effect| first


def test_a_missing_warehouse_is_named(tmp_path):
    with pytest.raises(WarehouseError, match="nowhere.duckdb does not exist"):
        data.runs(tmp_path / "nowhere.duckdb")


def test_the_command_refuses_a_missing_warehouse_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "patchgrid", "dashboard", "--warehouse", str(tmp_path / "no.duckdb")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [f"patchgrid: error: --warehouse {tmp_path / 'no.duckdb'}: no "
                                               "warehouse file there (run a study into it first)"]


def _wait_healthy(port: int, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the dashboard exited ({proc.returncode})"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the dashboard did not come up in time")


def _children(pid: int) -> list[int]:
    """The processes `pid` started (Linux's /proc)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _start(warehouse, tmp_path) -> tuple[subprocess.Popen, int, int]:
    """`patchgrid dashboard` in a process group of its own, up: the process, its port and the
    Streamlit server's process group."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "patchgrid", "dashboard", "--warehouse", str(warehouse),
                             "--port", str(port), "--refresh", "1"], cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(port, proc, time.monotonic() + 60)
        (server,) = _children(proc.pid)
        return proc, port, os.getpgid(server)
    except BaseException:
        _kill(proc.pid, proc)
        raise


def _kill(pgid: int, proc: subprocess.Popen) -> None:
    for group in {pgid, proc.pid}:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.engine  # Chromium and a Streamlit server: as heavy as an engine test (tests/support/tiers.py)
@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (make test installs Debian's chromium)")
def test_page_shows_a_runs_heatmap_and_a_run_loaded_while_it_is_open(warehouse, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    deadline = time.monotonic() + 90
    proc, port, server = _start(warehouse, tmp_path)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"])
            page = browser.new_page(viewport={"width": 1366, "height": 900})
            page.goto(f"http://127.0.0.1:{port}/", timeout=30_000)
            chart = page.locator("[data-testid='stVegaLiteChart']").first
            expect(chart.locator("canvas, svg").first).to_be_visible(timeout=30_000)
            expect(page.get_by_text("run-one: resid, denoise, logit_diff (all relations)")).to_be_visible()
            expect(page.get_by_role("cell", name="run-one", exact=True)).to_be_visible()
            box = chart.locator("canvas, svg").first.bounding_box()
            page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.4)
            tooltip = page.locator("#vg-tooltip-element")
            expect(tooltip).to_contain_text("n_pairs", timeout=10_000)  # hover: the cell's means, interval, count
            expect(tooltip).to_contain_text("ci95_low")
            page.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.4)  # a cell: its pairs
            expect(page.get_by_text("Pairs at layer")).to_be_visible(timeout=15_000)
            expect(page.get_by_role("cell", name="run-one-p3", exact=True)).to_be_visible()
            assert page.get_by_role("cell", name="run-two", exact=True).count() == 0
            load(warehouse, "run-two", n_pairs=2)  # a study landing while the page is open
            expect(page.get_by_role("cell", name="run-two", exact=True)).to_be_visible(timeout=20_000)
            # the latest run is the one drawn: its heatmap replaced the first one's
            expect(page.get_by_text("run-two: resid, denoise, logit_diff (all relations)")).to_be_visible(
                timeout=20_000)
            expect(page.locator("[data-testid='stVegaLiteChart']").first.locator("canvas, svg").first).to_be_visible()
            browser.close()
        assert time.monotonic() < deadline, "the browser test took longer than its 90 s"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at a terminal: the whole group
        assert proc.wait(timeout=15) == 128 + signal.SIGINT
        assert _group_gone(proc.pid) and _group_gone(server), "the dashboard left a process behind"
    finally:
        _kill(server, proc)


@pytest.mark.engine  # a Streamlit server: as heavy as an engine test (tests/support/tiers.py)
def test_sigterm_to_the_command_alone_stops_the_server(warehouse, tmp_path):
    proc, _, server = _start(warehouse, tmp_path)
    try:
        assert server != proc.pid  # the server's group is its own: the command must stop it
        proc.send_signal(signal.SIGTERM)  # a scheduler stopping the command
        assert proc.wait(timeout=15) == 128 + signal.SIGTERM
        wait = time.monotonic() + 5
        while not _group_gone(server) and time.monotonic() < wait:
            time.sleep(0.1)
        assert _group_gone(server), "the Streamlit server outlived the command"
    finally:
        _kill(server, proc)
