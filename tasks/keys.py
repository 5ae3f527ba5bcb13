"""Task cache keys from input fingerprints: files by content, parameters by value."""
from __future__ import annotations

from patchgrid.fingerprint import fingerprint

# Where a task writes is not one of its inputs.
OUTPUT_PARAMETERS = ("out",)


def inputs_key(context, parameters: dict) -> str:
    inputs = {k: v for k, v in parameters.items() if k not in OUTPUT_PARAMETERS}
    return f"{context.task.name}-{fingerprint(inputs)}"
