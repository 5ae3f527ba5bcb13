"""Fixtures this folder's tests share with the tests of another tier, defined once where those are."""
from tests.flow.warehouse.test_compare import real_runs  # noqa: F401
