"""docs/warehouse.md's "Every column" lists every view of a fresh warehouse with exactly its columns,
in order; and every view is described in the page's text too."""
from __future__ import annotations

import re

from patchgrid.warehouse.loader import connect, ensure
from tests.support.documents import ROOT

PAGE = ROOT / "docs" / "warehouse.md"


def listed() -> dict[str, list[str]]:
    """The page's column list: `- `view`: `col`, `col`, ...` lines under "## Every column"."""
    text = PAGE.read_text().split("\n## Every column\n", 1)[1].split("\n## ", 1)[0]
    views = {}
    for m in re.finditer(r"^- `(\w+)`: (.+)$", text, re.MULTILINE):
        views[m.group(1)] = re.findall(r"`(\w+)`", m.group(2))
    return views


def test_every_view_and_column_is_listed(tmp_path):
    path = tmp_path / "warehouse.duckdb"
    ensure(path)
    con = connect(path)  # what `patchgrid query` reads through
    try:
        views = [v for (v,) in con.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()]
        actual = {v: [c[0] for c in con.execute(f'DESCRIBE "{v}"').fetchall()] for v in views}
    finally:
        con.close()
    assert listed() == actual


def test_every_view_is_described():
    body = PAGE.read_text().split("\n## Every column\n", 1)[0]
    missing = [v for v in listed() if v != "published" and f"`{v}`" not in body]
    assert not missing, f"views in the column list that the page does not describe: {missing}"
