"""Every test's tier, a pytest marker given at collection (tests/conftest.py), from where the test is
and what it uses, so that no test file names its tier and none is left without one:

    reliability  tests/reliability/: real processes killed, caches damaged, engines dying
    flow         tests/flows/, or a test using the Prefect API (the `prefect_api` fixture)
    engine       a test using an engine (the `engines` fixture, directly or through another fixture),
                 needing vLLM, running the CLI (which starts engines in processes of its own), or one
                 of the few as heavy as one without an engine (AS_HEAVY_AS_AN_ENGINE: a model run in
                 process, Chromium, a whole report's figures rendered)
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
# Tests without an engine that take seconds each as engine tests do: a model run in process
# (transformers' modules, forward and backward), Chromium, or every figure of a report rendered to
# PNG. By module and function name; too slow for the unit tier.
AS_HEAVY_AS_AN_ENGINE = frozenset({
    "test_attribution.py::test_estimate_equals_finite_differences_of_the_linearisation",
    "test_attribution.py::test_estimate_equals_the_exact_patch_where_the_metric_is_linear_in_the_site",
    "test_attribution.py::test_graddrop_scores_are_the_mean_absolute_estimate_with_each_layers_backward_cut",
    "test_attribution_qk.py::test_the_reference_attention_is_saturated",
    "test_attribution_qk.py::test_the_qk_fix_is_closer_to_exact_patching_than_plain_atp_where_attention_saturates",
    "test_attribution_qk.py::test_the_qk_fix_is_the_recomputed_softmax_against_the_patterns_gradient",
    "test_attribution_qk.py::test_the_qk_fix_equals_plain_atp_to_first_order",
    "test_report.py::test_page_renders_in_headless_chromium",
    "test_report.py::test_report_files",
    "test_report.py::test_a_run_without_atp_rows_has_no_atp_section",
    "test_report.py::test_atp_section_on_the_page",
    "test_report.py::test_a_run_without_paths_rows_has_no_path_section",
    "test_report.py::test_path_section_on_the_page",
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
    if f"{where.as_posix()}::{getattr(item, 'originalname', item.name)}" in AS_HEAVY_AS_AN_ENGINE:
        return "engine"
    return "unit"


def _check_named_tests() -> None:
    """Every test named above still exists: a rename must not move a test to another tier unseen."""
    for name in AS_HEAVY_AS_AN_ENGINE:
        module, function = name.split("::")
        if f"def {function}(" not in (TESTS / module).read_text(encoding="utf-8"):
            raise pytest.UsageError(f"tests/support/tiers.py names {name}, which tests/{module} does not define")


def mark_tiers(items) -> None:
    _check_named_tests()
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
