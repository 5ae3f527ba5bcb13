"""Prompt pairs from CounterFact-style data, aligned by the tokenizer.

    read_source(path) -> records -> build_pairs(records, tokenizer, ...) -> rows -> write_pairs(rows, out)
"""
from ..rows.shapes import ROLES
from .align import position_roles
from .build import build_from_source, build_pairs, summary
from .limit import Limit
from .pair import Pair, accepted_pairs, traced_facts
from .sources import FORMATS, Record, SourceError, read_source
from .table import SCHEMA, read_pairs, to_table, write_pairs

__all__ = ["FORMATS", "build_from_source", "Limit", "Pair", "accepted_pairs", "ROLES", "SCHEMA", "Record",
           "SourceError", "build_pairs", "position_roles", "read_pairs", "read_source", "summary", "to_table",
           "traced_facts", "write_pairs"]
