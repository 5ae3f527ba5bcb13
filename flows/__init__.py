"""Prefect flows (patchgrid.flows): one flow per file."""
