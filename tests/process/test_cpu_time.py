"""tests/support/cpu_time.py, the opt-in plugin that says where the suite's CPU goes: a test's own CPU
seconds and those of the child processes it waited for, one CSV row per test."""
from __future__ import annotations

import csv
import subprocess
import sys
from types import SimpleNamespace

from tests.support import cpu_time


def _spin(seconds: float) -> None:
    import time

    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_tests_own_and_its_childrens_cpu_seconds_are_written(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_time, "_ROWS", [])
    monkeypatch.setenv("PATCHGRID_CPU_TIME_DIR", str(tmp_path))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    for name, work in (("tests/x.py::own", lambda: _spin(0.3)),
                       ("tests/x.py::child", lambda: subprocess.run(
                           [sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                                                  "while time.process_time() < end: pass"], check=True))):
        wrapper = cpu_time.pytest_runtest_protocol(SimpleNamespace(nodeid=name), None)
        next(wrapper)
        work()
        try:
            next(wrapper)
        except StopIteration:
            pass
    cpu_time.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace(
        invocation_params=SimpleNamespace(dir=tmp_path / "elsewhere"))))
    with open(tmp_path / "cpu-time.csv") as f:
        rows = {row["test"]: {k: float(v) for k, v in row.items() if k != "test"} for row in csv.DictReader(f)}
    assert set(rows) == {"tests/x.py::own", "tests/x.py::child"}
    own, child = rows["tests/x.py::own"], rows["tests/x.py::child"]
    assert own["own_cpu_s"] >= 0.29 and own["children_cpu_s"] == 0
    assert child["children_cpu_s"] >= 0.29 and child["own_cpu_s"] < 0.29
    for row in rows.values():
        assert abs(row["cpu_s"] - row["own_cpu_s"] - row["children_cpu_s"]) < 0.02 and row["wall_s"] >= 0.29
