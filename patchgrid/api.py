"""The Python API for notebooks: a warehouse's views as data frames, and a study run in this process.

    import patchgrid

    wh = patchgrid.open("warehouse.duckdb")
    wh.runs()                                    # every run, newest first (pandas)
    wh.view("effect_summary", metric="logprob_diff")

    run = patchgrid.study(model="tiny-llama", sweeps="resid", limit=2, require_known=False)
    run = patchgrid.study(config="study.toml", limit=4)   # a study file's settings, some overridden
    run.summary(), run.view("effect_summary"), run.report("report")

Everything reads through `patchgrid.warehouse.loader.query`, the sandbox `patchgrid query` reads
through: read-only, no files, no extensions. Frames are pandas unless `frame="polars"` is asked for.
"""
from __future__ import annotations

import difflib
from pathlib import Path

from .pipeline.spec import StudySpec
from .warehouse.loader import WarehouseError, query

__all__ = ["ALL", "Run", "Warehouse", "open", "study"]

ALL = "*"  # run=ALL: every run's rows (no run id is "*": spec.RUN_ID)
FRAMES = ("pandas", "polars")


def _frame(cols: list[str], rows: list[tuple], frame: str):
    """Rows as a pandas (or polars) data frame with these columns."""
    if frame == "pandas":
        import pandas as pd

        return pd.DataFrame.from_records(rows, columns=cols)
    if frame == "polars":
        try:
            import polars as pl
        except ImportError as exc:
            raise ImportError(f'frame="polars" needs the package polars (pip install polars): {exc}') from exc
        return pl.DataFrame(rows, schema=cols, orient="row")
    raise ValueError(f"frame {frame!r} is not one of {', '.join(FRAMES)}")


def _ident(name: str) -> str:
    """A view's or column's name quoted for SQL."""
    return '"' + name.replace('"', '""') + '"'


def _names_hint(what: str, name: str, valid: list[str]) -> str:
    """`what` (a view, a column of view x) that is not there, with the closest valid name and them all."""
    close = difflib.get_close_matches(name, valid, n=1)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    return f"no {what} {name!r}{guess}; valid: {', '.join(valid)}"


class Warehouse:
    """A patchgrid warehouse, read-only: its runs and its views as data frames."""

    def __init__(self, path: str | Path, frame: str = "pandas"):
        if frame not in FRAMES:
            raise ValueError(f"frame {frame!r} is not one of {', '.join(FRAMES)}")
        self.path = Path(path)
        self.frame = frame
        self.views()  # a warehouse that cannot be read says so now (WarehouseError), not on first use

    def __repr__(self) -> str:
        return f"patchgrid.open({str(self.path)!r})"

    def sql(self, sql: str, params=None, *, frame: str | None = None):
        """Any read-only SQL on the views (what `patchgrid query` runs), as a data frame."""
        return _frame(*query(self.path, sql, params), frame or self.frame)

    def views(self) -> list[str]:
        """The names of the warehouse's views (docs/warehouse.md describes each)."""
        _, rows = query(self.path, "SELECT table_name FROM information_schema.tables ORDER BY 1")
        return [name for (name,) in rows]

    def columns(self, name: str) -> list[str]:
        """The columns of view `name`, in order."""
        return [c for (c, *_) in self._read(name, [], f"DESCRIBE {_ident(name)}")[1]]

    def runs(self, *, frame: str | None = None):
        """Every run, newest first: the run_overview view (status, reason, parameters, counts of
        records, accepted and rejected pairs)."""
        return self.sql("SELECT * FROM run_overview ORDER BY started DESC NULLS LAST, run_id", frame=frame)

    def latest_run(self) -> str:
        """The id of the latest completed run (by its finish time)."""
        _, rows = query(self.path, "SELECT run_id FROM runs WHERE status = 'completed' "
                                   "ORDER BY finished DESC NULLS LAST, started DESC NULLS LAST LIMIT 1")
        if not rows:
            raise WarehouseError(f"warehouse {self.path} has no completed run (runs() lists its runs)")
        return rows[0][0]

    def view(self, name: str, run: str | None = None, *, sweep: str | None = None, metric: str | None = None,
             relation: str | None = None, columns: list[str] | None = None, frame: str | None = None):
        """The rows of view `name` (e.g. effect_summary, pair_effects, relation_summary, runs) as a data
        frame. run: a run id; None (the default) is the latest completed run; ALL ("*") every run's.
        sweep, metric, relation: keep the rows with that value (the view must have that column);
        columns: only these columns, in this order. An unknown view or column is refused, naming the
        valid ones."""
        where, params = [], []
        filters = {"sweep": sweep, "metric": metric, "relation": relation}
        if run != ALL and (run is not None or "run_id" in self.columns(name)):
            filters["run_id"] = self.latest_run() if run is None else run
        for column, value in filters.items():
            if value is not None:
                where.append(f"{_ident(column)} = ?")
                params.append(value)
        picked = "*" if columns is None else ", ".join(_ident(c) for c in columns)
        sql = f"SELECT {picked} FROM {_ident(name)}" + (" WHERE " + " AND ".join(where) if where else "")
        used = [c for c, v in filters.items() if v is not None]
        return _frame(*self._read(name, [*used, *(columns or [])], sql, params), frame or self.frame)

    def compare(self, run_a: str, run_b: str, *, sweep: str | None = None, metric: str | None = None,
                measure: str = "effect", top: int | None = None, frame: str | None = None):
        """Run B's averaged cells against run A's (what `patchgrid compare` prints): per cell, both runs'
        pairs and means, the difference B - A and its 95% t interval (paired over shared pairs, else
        Welch's), largest |difference| first (warehouse/compare.py)."""
        from .warehouse.compare import compare

        return _frame(*compare(self.path, run_a, run_b, sweep=sweep, metric=metric, measure=measure, top=top),
                      frame or self.frame)

    def _read(self, name: str, wanted: list[str], sql: str, params=None) -> tuple[list[str], list[tuple]]:
        """query() on view `name` naming columns `wanted`; a view or column that is not there is
        refused with DuckDB's error, the closest name and the valid ones."""
        try:
            return query(self.path, sql, params)
        except WarehouseError as exc:
            explained = self._explained(name, wanted, exc)
            if explained is None:
                raise
            raise explained from exc

    def _explained(self, name: str, wanted: list[str], exc: WarehouseError) -> WarehouseError | None:
        """A failed read of view `name` explained: the view or column that is not there, with the valid
        ones; None when both are there (the error is about something else)."""
        views = self.views()
        if name not in views:
            return WarehouseError(f"{exc}: {_names_hint('view', name, views)}")
        have = [c for (c, *_) in query(self.path, f"DESCRIBE {_ident(name)}")[1]]
        missing = [c for c in wanted if c not in have]
        if missing:
            return WarehouseError(f"{exc}: {_names_hint(f'column in view {name}', missing[0], have)}")
        return None


def open(warehouse: str | Path = "warehouse.duckdb", *, frame: str = "pandas") -> Warehouse:  # noqa: A001
    """The warehouse at `warehouse` (its DuckDB file, as `--warehouse` names it), read-only; its
    frames are pandas, or polars with frame="polars" (needs the package polars)."""
    return Warehouse(warehouse, frame)


class Run:
    """One study's run in a warehouse: its id, what it did, its views and its report."""

    def __init__(self, run_id: str, warehouse: str | Path, frame: str = "pandas"):
        self.run_id = run_id
        self.warehouse = Warehouse(warehouse, frame)

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, warehouse={str(self.warehouse.path)!r})"

    def view(self, name: str, **filters):
        """The view's rows of this run (Warehouse.view's filters, columns and frame)."""
        return self.warehouse.view(name, self.run_id, **filters)

    def summary(self, per_sweep: int = 3) -> dict:
        """What the run did, as a dict (what `patchgrid study --json` prints; patchgrid.pipeline.summary): model,
        status, seconds, records read, accepted, rejected (by reason) and not judged, each sweep with its pairs and
        patched runs, the `per_sweep` strongest averaged cells of each sweep and direction (effect_summary:
        metric, mean recovery or effect, 95% interval, n_pairs, `ranked_by`: denoising by recovery, noising
        by 1 - recovery), and the commands that query and report it."""
        from .pipeline.summary import study_summary

        return study_summary(self.warehouse.path, self.run_id, per_sweep)

    def report(self, out: str | Path = "report") -> Path:
        """Write the run's HTML report (what `patchgrid report` writes) into folder `out`; returns the
        page's path."""
        from .report import write_report

        return write_report(self.warehouse.path, out, self.run_id)


def study(config: str | Path | None = None, **settings) -> Run:
    """Run a study in this process and return its Run. settings: those of `patchgrid study`, by their
    Python names (StudySpec.of: model, pairs, sweeps, limit, warehouse, require_known, backend, ...).
    config: a study file (TOML, as `patchgrid study --config` takes: patchgrid.pipeline.studyfile), whose
    settings the others given here override; its content is recorded with the run.
    The study flow runs here; it needs a Prefect API (PREFECT_API_URL), or starts Prefect's
    temporary one. A rerun with the same settings is the same run, found in the caches."""
    if config is not None:
        from .pipeline.studyfile import read_study_file

        given, text = read_study_file(config)
        settings = {**given, **settings, "config": text}
    source = Path(str(settings.get("pairs", "")))
    if "pairs" in settings and source.exists():  # the flow's tasks are cached by the data set's path
        settings["pairs"] = str(source.resolve())
    spec = StudySpec.of(**settings)
    spec.check_inputs()
    from .flows.study import study as study_flow

    run_id = study_flow(spec)
    return Run(run_id, spec.warehouse)
