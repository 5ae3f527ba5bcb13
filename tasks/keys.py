"""Task cache keys from the inputs a task's result depends on: files by content, parameters by value,
outputs by path."""
from __future__ import annotations

import os

from patchgrid.engine import EnginePool
from patchgrid.fingerprint import OutputPath, fingerprint
from patchgrid.spec import StudySpec

# Where a task writes counts by its path, not by what an earlier run left there.
OUTPUT_PARAMETERS = ("out",)


def keyed_on(*study_fields: str):
    """A cache key function: the named fields of the task's StudySpec, and every other parameter
    (the engine pool, which holds no input, aside)."""
    unknown = set(study_fields) - set(StudySpec.__dataclass_fields__)
    if unknown:
        raise ValueError(f"StudySpec has no field {sorted(unknown)[0]!r}")

    def key(context, parameters: dict) -> str:
        inputs = {}
        for name, value in parameters.items():
            if isinstance(value, EnginePool):
                continue
            if isinstance(value, StudySpec):
                value = {f: getattr(value, f) for f in study_fields}
            elif name in OUTPUT_PARAMETERS:
                value = OutputPath(os.path.abspath(value))
            inputs[name] = value
        return f"{context.task.name}-{fingerprint(inputs)}"

    return key
