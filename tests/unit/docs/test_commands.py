"""Every `patchgrid ...` command shown in the docs parses with the real parser: every subcommand,
flag and choice exists. Commands are read from fenced blocks by Sybil: every line of a ```bash
block, and the `$ ` lines of ```console and ```text blocks (a command goes on over lines ending in
a backslash or inside an open quote); a `.venv/bin/` prefix and a leading `eval` are dropped."""
from __future__ import annotations

import contextlib
import io
import shlex
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

from patchgrid.cli import build_parser
from tests.support.documents import DOCS, ROOT, name

OPERATORS = {"&&", "||", ";", "|", "&"}


def logical_lines(language: str, source: str):
    """The shell commands of one block, each as one string."""
    buf = ""
    for line in source.splitlines():
        if not buf:
            if language != "bash":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
        buf = f"{buf}\n{line}" if buf else line
        if buf.endswith("\\"):
            buf = buf[:-1]
            continue
        try:
            shlex.split(buf, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        yield buf
        buf = ""
    assert not buf, f"an unfinished command: {buf!r}"


def patchgrid_commands(language: str, source: str) -> list[list[str]]:
    """The argument lists given to `patchgrid` in one block."""
    found = []
    for line in logical_lines(language, source):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        segment: list[str] = []
        for token in [*lexer, ";"]:
            if token not in OPERATORS:
                segment.append(token)
                continue
            while segment and (segment[0] in ("eval", "time") or "=" in segment[0].split("/")[0]):
                segment.pop(0)  # eval, time, VAR=value
            if segment and Path(segment[0]).name == "patchgrid":
                found.append(segment[1:])
            segment = []
    return found


class CommandBlocks:
    """A Sybil parser: each shell-like fenced block, evaluated by parsing its patchgrid commands."""

    def __init__(self):
        self.lexer = FencedCodeBlockLexer(language=r"bash|console|text")

    def __call__(self, document):
        for region in self.lexer(document):
            region.parsed = (region.lexemes["language"], region.lexemes["source"])
            region.evaluator = check_block
            yield region


def parse_error(argv: list[str]) -> str | None:
    """argparse's complaint about `patchgrid ARGV`, or None when it parses."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


def check_block(example) -> str | None:
    language, source = example.parsed
    failures = []
    for argv in patchgrid_commands(language, str(source)):
        error = parse_error(argv)
        if error:
            failures.append(f"patchgrid {shlex.join(argv)}\n    {error}")
    return "\n".join(failures) or None


SYBIL = Sybil(parsers=[CommandBlocks()], path=str(ROOT))
BLOCKS = [example for doc in DOCS for example in SYBIL.parse(doc)
          if patchgrid_commands(*map(str, example.parsed))]


@pytest.mark.parametrize("example", BLOCKS, ids=[f"{name(Path(e.path))}:{e.line}" for e in BLOCKS])
def test_the_commands_parse(example):
    example.evaluate()


def test_the_docs_show_commands_of_every_kind():
    """The reader above finds the docs' commands (a reader that found none would pass vacuously)."""
    shown = {argv[0] for e in BLOCKS for argv in patchgrid_commands(*map(str, e.parsed))}
    assert {"patch", "paths", "pairs", "sweep", "study", "serve", "query", "report", "models"} <= shown


@pytest.mark.parametrize("source, expected", [
    ('.venv/bin/patchgrid query --warehouse w.duckdb \\\n    "SELECT 1"',
     [["query", "--warehouse", "w.duckdb", "SELECT 1"]]),
    ("export X=1   # a comment\neval patchgrid demo --quick && make test", [["demo", "--quick"]]),
])
def test_commands_are_read_whole(source, expected):
    assert patchgrid_commands("bash", source) == expected


def test_a_flag_that_does_not_exist_fails():
    assert "unrecognized arguments: --no-such-flag" in parse_error(["demo", "--no-such-flag"])
