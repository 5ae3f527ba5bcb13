"""Fixtures this folder's tests share with the tests of another tier, defined once where those are."""
from tests.unit.dashboard.test_dashboard import warehouse  # noqa: F401
