"""The pipeline's steps (patchgrid.pipeline.steps), which the study flow's tasks and `patchgrid sweep`
both call, and the one rule both take a run's default id from."""
from __future__ import annotations

import subprocess
import sys


def test_the_steps_import_no_prefect():
    """Both drivers call the steps; `patchgrid sweep` runs without Prefect."""
    code = "import sys, patchgrid.pipeline.steps, patchgrid.cli.data; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

