"""The Python API (patchgrid.open, patchgrid.study): views as pandas frames through the query sandbox,
the latest completed run by default, errors naming the valid views and columns; and one study run
in process, on tiny-llama, through its summary, frames and report."""
from __future__ import annotations

import subprocess
import sys

import pytest

import patchgrid


def test_import_patchgrid_stays_light():
    code = ("import sys, patchgrid; heavy = [m for m in ('pandas', 'duckdb', 'patchgrid.api') if m in sys.modules]; "
            "assert not heavy, heavy; assert callable(patchgrid.open) and callable(patchgrid.study); "
            "assert 'pandas' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with pytest.raises(AttributeError, match="no attribute 'opne'"):
        patchgrid.opne  # noqa: B018

