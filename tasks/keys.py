"""Task cache keys from the values a task's result depends on: files by content, parameters by
value, outputs by path. A task declares those values once, as a function of its parameters that its
body computes with too (`keyed_by`), so that a key cannot leave out what the result depends on."""
from __future__ import annotations

import inspect
import os
from collections.abc import Callable

from patchgrid.backends.engine import EnginePool, Engines
from patchgrid.pipeline.fingerprint import OutputPath, fingerprint

# Where a task writes counts by its path, not by what an earlier run left there.
OUTPUT_PARAMETERS = ("out",)


def keyed_by(inputs: Callable[..., dict]):
    """A cache key function: `inputs(**parameters)` (the values the task's result depends on, which
    the task's body computes from its parameters with the same function), beside every parameter
    `inputs` does not take (the engines, which hold no input, aside)."""
    taken = set(inspect.signature(inputs).parameters)

    def key(context, parameters: dict) -> str:
        values = {"inputs": inputs(**{k: v for k, v in parameters.items() if k in taken})}
        for name, value in parameters.items():
            if name in taken or isinstance(value, (EnginePool, Engines)):
                continue
            values[name] = OutputPath(os.path.abspath(value)) if name in OUTPUT_PARAMETERS else value
        return f"{context.task.name}-{fingerprint(values)}"

    return key


def engine_inputs(spec) -> dict:
    """Which engine a task's results come from (a study's model, backend and dtype)."""
    return spec.engine_identity()
