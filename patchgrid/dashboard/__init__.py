"""The live dashboard (`patchgrid dashboard`): a Streamlit page over the warehouse's views.

    data.py  what the page reads: the runs, a run's filters, a sweep's cells, one pair's grid;
             plain functions over the warehouse's read-only query sandbox (no Streamlit)
    app.py   the page itself, run by `streamlit run` (patchgrid/cli/dashboard.py starts it)
"""
from __future__ import annotations

from pathlib import Path

APP = Path(__file__).with_name("app.py")

__all__ = ["APP"]
