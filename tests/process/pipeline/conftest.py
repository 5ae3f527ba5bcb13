"""Fixtures this folder's tests share with the tests of another tier, defined once where those are."""
from tests.unit.pipeline.test_fingerprint_records import _home, reads  # noqa: F401
