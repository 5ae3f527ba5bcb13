"""Commands on the warehouse: the report, read-only SQL and two runs compared, printed or written as a file."""
from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from ..runtime.console import format_rows
from .common import UsageError

QUERY_FORMATS = ("table", "csv", "json", "parquet")


@contextmanager
def removed_on_failure(folder: str | Path):
    """The folders of `folder` that are not there yet are made; the command failing, the topmost
    one made is removed with what is in it, so that a failed command leaves no folder it made."""
    folder = Path(folder)
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    except BaseException:
        if missing:
            shutil.rmtree(missing[-1], ignore_errors=True)
        raise


def cmd_report(args) -> int:
    from ..report.page import drawn_run, write_report

    with removed_on_failure(args.out):
        page = write_report(args.warehouse, args.out, args.run, circuit_size=args.circuit_size)
    print(f"report of run {drawn_run(args.out)}: {page}")
    return 0


def cmd_query(args) -> int:
    from ..warehouse.loader import query

    return show_result(args.format, args.out, lambda arrow: query(args.warehouse, args.sql, arrow=arrow))


def cmd_compare(args) -> int:
    from ..warehouse.compare import compare

    return show_result(args.format, args.out, lambda arrow: compare(
        args.warehouse, args.run_a, args.run_b, sweep=args.sweep, metric=args.metric, measure=args.measure,
        top=args.top, arrow=arrow))


def show_result(fmt: str, out: str | None, read) -> int:
    """A read of the warehouse printed, or written into file `out`, in format `fmt` (QUERY_FORMATS);
    read(arrow): its (columns, rows), or a pyarrow table when `arrow`."""
    if fmt == "parquet" and out is None:
        raise UsageError("--format parquet needs --out FILE (Parquet is binary, not for the terminal)")
    # the sandbox's query, whatever the format: a query that fails writes nothing
    if fmt == "parquet":
        table = read(True)
        write_whole(out, lambda f: _write_parquet(table, f))
        print(f"{table.num_rows} rows -> {out}", file=sys.stderr)
        return 0
    cols, rows = read(False)
    text = {"table": _table, "csv": _csv, "json": _json}[fmt](cols, rows)
    if out is None:
        sys.stdout.write(text)
    else:
        write_whole(out, lambda f: f.write(text.encode()))
        print(f"{len(rows)} rows -> {out}", file=sys.stderr)
    return 0


def write_whole(path: str | Path, write) -> Path:
    """`write(binary file)` into `path` under a temporary name, renamed into place when done: never
    a half-written file under the real name; its folder made when missing (and removed again if the
    write fails)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--out {path} is a folder, not a file")
    with removed_on_failure(path.parent):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _table(cols, rows) -> str:
    return format_rows(cols, rows) + "\n"


def _csv(cols, rows) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(cols)
    w.writerows(rows)
    return out.getvalue()


def _plain(value):
    """A value as JSON holds it: NaN and infinities as null, dates and decimals as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _json(cols, rows) -> str:
    """A list of objects, one row a line."""
    records = [json.dumps(dict(zip(cols, (_plain(v) for v in r))), default=str) for r in rows]
    return "[\n" + ",\n".join(records) + "\n]\n" if records else "[]\n"


def _write_parquet(table, f) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table, f)
