"""Every test's tier, a pytest marker given at collection (tests/conftest.py), from where the test is
and what it uses, so that no test file names its tier and none is left without one:

    reliability  tests/reliability/: real processes killed, caches damaged, engines dying
    flow         tests/flows/, or a test using the Prefect API (the `prefect_api` fixture)
    engine       a test using an engine (the `engines` fixture, directly or through another fixture),
                 needing vLLM, running the CLI (which starts engines in processes of its own), or one
                 of the few that run a model in process or drive a browser (RUNS_A_MODEL_OR_PROGRAM)
    unit         everything else: fast, no engine, no Prefect (`make test-fast` runs these)

A test that names one of these markers itself keeps it. `slow` (the pretrained smollm2 model) is
independent of the tier.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.engines import needs_vllm

TIERS = ("unit", "engine", "flow", "reliability")
# Test modules whose tests start engines in processes of their own (no fixture says so).
ENGINES_IN_PROCESSES = frozenset({"test_cli.py"})
# Tests without an engine that run a model in process (transformers' modules, forward and backward)
# or a program of their own: seconds each, too slow for the unit tier. By module and function name.
RUNS_A_MODEL_OR_PROGRAM = frozenset({
    "test_attribution.py::test_estimate_equals_finite_differences_of_the_linearisation",
    "test_attribution.py::test_estimate_equals_the_exact_patch_where_the_metric_is_linear_in_the_site",
    "test_attribution.py::test_graddrop_scores_are_the_mean_absolute_estimate_with_each_layers_backward_cut",
    "test_report.py::test_page_renders_in_headless_chromium",  # Chromium
})
TESTS = Path(__file__).resolve().parents[1]


def _needs_vllm(item) -> bool:
    return any(m.name == "skipif" and m.kwargs.get("reason") == needs_vllm.kwargs["reason"]
               for m in item.iter_markers())


def tier_of(item) -> str:
    """The tier `item` belongs to (its own marker, else by where it is and what it uses)."""
    named = [t for t in TIERS if item.get_closest_marker(t) is not None]
    if len(named) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked {' and '.join(named)}: a test has one tier")
    if named:
        return named[0]
    where = Path(item.path).resolve().relative_to(TESTS)
    if where.parts[0] == "reliability":
        return "reliability"
    if where.parts[0] == "flows" or "prefect_api" in item.fixturenames:
        return "flow"
    if "engines" in item.fixturenames or _needs_vllm(item) or where.as_posix() in ENGINES_IN_PROCESSES:
        return "engine"
    if f"{where.as_posix()}::{getattr(item, 'originalname', item.name)}" in RUNS_A_MODEL_OR_PROGRAM:
        return "engine"
    return "unit"


def mark_tiers(items) -> None:
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
