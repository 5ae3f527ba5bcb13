"""A study's limit on judging: the records are judged in the data set's order, a batch at a time,
and judging stops once the judged records hold the first N members of every population the study
runs (accepted pairs; for causal tracing, facts the model knows alone). The records not reached
are not judged: each keeps its row, rejected as `limit_reached`."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .pair import accepted_pairs
from .table import to_table

FIRST_BATCH = 8  # records judged at least in the first batch; each next batch is twice the one before
NOT_JUDGED = "limit_reached"  # the reason of a record the judging never reached: not judged, so not refused either


@dataclass(frozen=True)
class Limit:
    n: int
    selects: tuple[Callable, ...] = (accepted_pairs,)  # (pairs table, limit) -> members, one per population
    counted: tuple[str, ...] = ("pairs",)  # what the members of each are called

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"limit {self.n}: at least 1 pair must be asked for")

    def reached(self, rows: list[dict | None]) -> bool:
        """Whether the judged records `rows` (a prefix of the data set) hold N members of every population."""
        table = to_table([r for r in rows if r is not None])
        return all(len(select(table, self.n)) >= self.n for select in self.selects)

    def reason(self) -> tuple[str, str]:
        found = " and ".join(f"{self.n} {what}" for what in self.counted)
        return (NOT_JUDGED, f"not judged: the study's limit was reached before this record ({found} found "
                                 "in the records before it, in the data set's order)")


def batches(order: list[int], limit: Limit | None) -> Iterator[list[int]]:
    """`order` (record indices) in the batches they are judged in: all at once without a limit;
    with one, N (at least FIRST_BATCH) first, then twice as many each batch."""
    size = len(order) if limit is None else max(limit.n, FIRST_BATCH)
    start = 0
    while start < len(order):
        yield order[start:start + size]
        start += size
        size *= 2
