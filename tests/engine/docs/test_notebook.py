"""The example notebook (docs/examples/study.ipynb) runs top to bottom in a real Jupyter kernel (nbclient,
ipykernel's python3 of this environment), in a folder of its own, against the session's Prefect server.
(Where no server is set, as in a user's first notebook, a study starts Prefect's temporary one: the
two studies of tests/process/test_concurrency.py run it that way.)"""
from __future__ import annotations

import time

from tests.support.paths import REPO

NOTEBOOK = REPO / "docs" / "examples" / "study.ipynb"
CELL_TIMEOUT_S = 300  # one cell (the study: the model, two pairs) at most
TOTAL_S = 600


def _text(cell) -> str:
    """What a code cell showed: its streams and its results' plain text."""
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", ""))
        out.append(o.get("data", {}).get("text/plain", ""))
    return "".join(out)


def test_the_example_notebook_runs(prefect_server_api, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # the kernel inherits this environment: the session's Prefect server, a Prefect home of its own
    monkeypatch.setenv("PREFECT_API_URL", prefect_server_api)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, startup_timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    started = time.monotonic()
    client.execute()  # a cell that raises fails the test (CellExecutionError, with the cell and its traceback)
    assert time.monotonic() - started < TOTAL_S

    code = [c for c in nb.cells if c.cell_type == "code"]
    shown = [_text(c) for c in code]
    assert "Run('run-" in shown[0]
    assert shown[1].startswith("completed {'read': ") and "'rejected_by_reason'" in shown[1]
    assert "'sweep': 'resid'" in shown[1] and "ci95_low" in shown[1]
    assert "completed" in shown[2]
    # the pivot: layers down, position roles across
    assert "position_role" in shown[3] and "layer" in shown[3] and "subject_last" in shown[3]
    assert "2 pairs" in shown[4]
    assert (tmp_path / "warehouse.duckdb").exists() and (tmp_path / "report" / "report.html").exists()
