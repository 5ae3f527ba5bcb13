"""patchgrid: activation-patching studies over many prompt pairs on vLLM.

`patchgrid.open(warehouse)` and `patchgrid.study(**settings)` are the Python API for notebooks
(patchgrid.api, docs/python.md), imported on first use so that `import patchgrid` stays light."""

import importlib

__version__ = "0.1.0"

__all__ = ["__version__", "open", "study"]
_API = ("open", "study")


def __getattr__(name: str):
    # imported by name, on first use: the package's own import pulls nothing in, and the layers
    # below the API (the flow reads patchgrid.__version__) do not depend on it (pyproject's layers)
    if name in _API:
        return getattr(importlib.import_module("patchgrid.api"), name)
    raise AttributeError(f"module 'patchgrid' has no attribute {name!r}")
