"""The accepted pairs as plain typed values, for the cache and the sweeps."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import pyarrow as pa


@dataclass(frozen=True)
class Pair:
    pair_id: str
    relation: str | None
    clean_ids: tuple[int, ...]
    corrupt_ids: tuple[int, ...]
    clean_answer_ids: tuple[int, ...]  # every token scored: one under the single and first-token policies
    corrupt_answer_ids: tuple[int, ...]
    subject_start: int
    subject_end: int  # exclusive
    roles: tuple[str, ...]

    def __post_init__(self):
        if not self.clean_answer_ids or not self.corrupt_answer_ids:
            raise ValueError(f"pair {self.pair_id}: an answer has no tokens")

    @property
    def subject_positions(self) -> tuple[int, ...]:
        return tuple(range(self.subject_start, self.subject_end))

    @property
    def clean_answer_id(self) -> int:
        """The clean answer's first token (the logit difference and the rank read it)."""
        return self.clean_answer_ids[0]

    @property
    def corrupt_answer_id(self) -> int:
        return self.corrupt_answer_ids[0]

    @cached_property
    def answers(self) -> tuple[int, int]:
        """Both answers' first tokens, read at the last prompt position (made once: every run of the
        pair reads it)."""
        return (self.clean_answer_id, self.corrupt_answer_id)

    @cached_property
    def continuations(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Both answers, scored token by token after the prompt (made once)."""
        return (self.clean_answer_ids, self.corrupt_answer_ids)


def _answer_ids(row: dict, which: str) -> tuple[int, ...]:
    """A pairs-table row's answer tokens (tables written before answers were scored whole hold the
    first token only)."""
    ids = row.get(f"{which}_answer_ids")
    return tuple(ids) if ids else (row[f"{which}_answer_id"],)


def traced_facts(table: pa.Table, limit: int | None = None) -> list[Pair]:
    """The facts causal tracing runs on, as Meng et al. choose them: every record whose clean
    prompt stands alone (`usable_alone`) and whose top-1 prediction is its answer (`known_alone`),
    with a subject-swap partner or not; `limit` keeps the first N. Tracing reads only the clean
    side: a fact with no partner is its own "corrupt" prompt, with its own answer twice."""
    out = []
    for row in table.to_pylist():
        if not (row["usable_alone"] and row["known_alone"]):
            continue
        paired = row["status"] == "accepted"
        clean = _answer_ids(row, "clean")
        out.append(Pair(row["pair_id"], row["relation"], tuple(row["clean_ids"]),
                        tuple(row["corrupt_ids"] if paired else row["clean_ids"]), clean,
                        _answer_ids(row, "corrupt") if paired else clean, row["subject_start"],
                        row["subject_end"], tuple(row["roles"])))
        if limit is not None and len(out) >= limit:
            break
    return out


def accepted_pairs(table: pa.Table, limit: int | None = None) -> list[Pair]:
    """Accepted rows of a pairs table, in table order; `limit` keeps the first N."""
    out = []
    for row in table.to_pylist():
        if row["status"] != "accepted":
            continue
        out.append(Pair(row["pair_id"], row["relation"], tuple(row["clean_ids"]), tuple(row["corrupt_ids"]),
                        _answer_ids(row, "clean"), _answer_ids(row, "corrupt"), row["subject_start"],
                        row["subject_end"], tuple(row["roles"])))
        if limit is not None and len(out) >= limit:
            break
    return out
