"""What a study runs its sweep kinds on, chosen from the run's pairs table: each kind declares its
population (SweepKind.population); the flow groups a run's kinds by it, and caches and shards
each group on its own, in the order of POPULATIONS."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..pairs.pair import accepted_pairs, traced_facts


@dataclass(frozen=True)
class Population:
    name: str
    select: Callable  # (pairs table, limit) -> [Pair]
    missing: str  # why a study stops when it is empty ({pairs}: the data set, {table}: the pairs table)
    counted_as: str  # what the flow's last log line calls its members
    shard_name: str = "shard"  # its effect files: <shard_name>-<index>.parquet
    writes_baselines: bool = True  # its shards write the pairs' baselines (the warehouse's)
    asks_model: bool = False  # choosing it needs the model's predictions: aligning the pairs asks the model
    recorded: tuple[tuple[str, str], ...] = ()  # what a run records of it, beside the noise, when noised


ACCEPTED_PAIRS = Population("accepted_pairs", accepted_pairs, "no accepted pairs in {pairs}: see the rejections in "
                            "{table}", "pairs")
# causal tracing runs on the facts the model knows alone, partner or not (Meng et al.)
TRACED_FACTS = Population(
    "traced_facts", traced_facts, "no fact in {pairs} that the model knows alone (its top prediction the answer): "
    "nothing to trace; see {table}", "traced facts", shard_name="trace-shard", writes_baselines=False,
    asks_model=True,
    recorded=(("traced", "facts whose top-1 prediction is the answer (known_alone), with or without a partner"),))

POPULATIONS = (ACCEPTED_PAIRS, TRACED_FACTS)  # in the order a study caches and shards them
