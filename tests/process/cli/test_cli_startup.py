"""The light commands start fast: the parser, `--help` and a warehouse's `query` import no torch, vLLM,
transformers or Prefect (seconds of imports a process; the suite runs the CLI in dozens of them)."""
from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "vllm", "transformers", "prefect")


def test_the_parser_and_a_query_import_no_torch_vllm_transformers_or_prefect(tmp_path):
    from patchgrid.warehouse.loader import ensure

    warehouse = tmp_path / "w.duckdb"
    ensure(warehouse)  # an empty warehouse
    code = ("import sys\n"
            "from patchgrid.cli import _main\n"
            f"code = _main(['query', '--warehouse', {str(warehouse)!r}, 'SELECT 42 + count(*) AS answer FROM runs'])\n"
            f"print(code, sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    *table, last = res.stdout.strip().splitlines()
    assert "42" in "\n".join(table), res.stdout  # the query ran
    assert last == "0 []", f"a light command imported {last}: import them where they are used\n{res.stdout}"
