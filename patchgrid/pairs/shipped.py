"""The data sets that ship with patchgrid, found wherever it is installed (package data)."""
from __future__ import annotations

from importlib import resources

# data/ in the checkout, installed as the package patchgrid.data
SHIPPED_PAIRS = str(resources.files("patchgrid.data").joinpath("pairs", "facts.jsonl"))
