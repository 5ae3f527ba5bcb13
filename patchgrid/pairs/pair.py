"""The accepted pairs as plain typed values, for the cache and the sweeps."""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class Pair:
    pair_id: str
    relation: str | None
    clean_ids: tuple[int, ...]
    corrupt_ids: tuple[int, ...]
    clean_answer_id: int
    corrupt_answer_id: int
    subject_start: int
    subject_end: int  # exclusive
    roles: tuple[str, ...]

    @property
    def subject_positions(self) -> tuple[int, ...]:
        return tuple(range(self.subject_start, self.subject_end))


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
        out.append(Pair(row["pair_id"], row["relation"], tuple(row["clean_ids"]),
                        tuple(row["corrupt_ids"] if paired else row["clean_ids"]), row["clean_answer_id"],
                        row["corrupt_answer_id"] if paired else row["clean_answer_id"], row["subject_start"],
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
                        row["clean_answer_id"], row["corrupt_answer_id"], row["subject_start"], row["subject_end"],
                        tuple(row["roles"])))
        if limit is not None and len(out) >= limit:
            break
    return out
