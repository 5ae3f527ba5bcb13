"""Prefect tasks (patchgrid.tasks), thin over the library."""
