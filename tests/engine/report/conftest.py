"""Fixtures this folder's tests share with the tests of another tier, defined once where those are."""
from tests.unit.report.test_report import atp_warehouse, collected, paths_warehouse, warehouse  # noqa: F401
