"""Task cache keys from input fingerprints: files by content, parameters by value."""
from __future__ import annotations

import os

from patchgrid.fingerprint import fingerprint

# Where a task writes counts by its path, not by what an earlier run left there.
OUTPUT_PARAMETERS = ("out",)


def inputs_key(context, parameters: dict) -> str:
    inputs = {k: ({"output": os.path.abspath(v)} if k in OUTPUT_PARAMETERS else v) for k, v in parameters.items()}
    return f"{context.task.name}-{fingerprint(inputs)}"
