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

import pytest

from patchgrid.runtime.serving import wait_healthy
from tests.support.prefect_server import free_port
from tests.unit.dashboard.test_dashboard import load

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_command_refuses_a_missing_warehouse_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "patchgrid", "dashboard", "--warehouse", str(tmp_path / "no.duckdb")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [f"patchgrid: error: --warehouse {tmp_path / 'no.duckdb'}: no "
                                               "warehouse file there (run a study into it first)"]


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    """Streamlit's health endpoint answering, asked as `patchgrid serve` asks its Prefect server's."""
    if not wait_healthy(f"http://127.0.0.1:{port}/_stcore/health", proc, timeout_s, every_s=0.2):
        assert proc.poll() is None, f"the dashboard exited ({proc.returncode})"
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
        _wait_healthy(port, proc, 60)
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

