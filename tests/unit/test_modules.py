"""What every module of the library keeps to (CONTRIBUTING.md, Lint): no module imports another
module's `_private` names, and none grows past MAX_LINES."""
from __future__ import annotations

import ast

from tests.support.paths import REPO

FOLDERS = ("patchgrid", "flows", "tasks", "warehouse")
MAX_LINES = 500


def modules():
    return [path for folder in FOLDERS for path in sorted((REPO / folder).rglob("*.py"))]


def test_no_module_imports_another_modules_private_names():
    found = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                found += [f"{path.relative_to(REPO)}:{node.lineno} {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, found


def test_no_module_grows_past_its_limit():
    lines = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in modules()}
    long = {path: n for path, n in lines.items() if n > MAX_LINES}
    assert not long, f"split these by what their parts do: {long}"
