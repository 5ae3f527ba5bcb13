"""The DuckDB warehouse (patchgrid.warehouse): schema, views and loader."""
