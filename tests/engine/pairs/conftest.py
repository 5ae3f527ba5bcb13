"""Fixtures this folder's tests share with the tests of another tier, defined once where those are."""
from tests.unit.pairs.test_limit import known  # noqa: F401
