"""Commands on the warehouse: the report and read-only SQL."""
from __future__ import annotations

from ..console import format_rows


def cmd_report(args) -> int:
    from ..report import write_report

    print(write_report(args.warehouse, args.out, args.run))
    return 0


def cmd_query(args) -> int:
    from ..warehouse.loader import query

    print(format_rows(*query(args.warehouse, args.sql)))
    return 0


