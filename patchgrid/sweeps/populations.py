"""What a study runs its sweep kinds on, chosen from the run's pairs table: each kind declares its
population (SweepKind.population); the flow groups a run's kinds by it, and caches and shards
each group on its own, in the order of POPULATIONS."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..pairs.known import trace_rejection
from ..pairs.pair import accepted_pairs, traced_facts


@dataclass(frozen=True)
class Population:
    name: str
    select: Callable  # (pairs table, limit) -> [Pair]
    missing: str  # why a study stops when it is empty ({pairs}: the data set); see nothing_to_run
    counted_as: str  # what the flow's last log line calls its members
    shard_name: str = "shard"  # its effect files: <shard_name>-<index>.parquet
    writes_baselines: bool = True  # its shards write the pairs' baselines (the warehouse's)
    asks_model: bool = False  # choosing it needs the model's predictions: aligning the pairs asks the model
    recorded: tuple[tuple[str, str], ...] = ()  # what a run records of it, beside the noise, when noised
    fix: str | None = None  # the likely fix when it is empty, before any the rejections suggest
    rule: str | None = None  # the sweep setting (SweepConfig field) whose value `select` takes as `rule`

    def members(self, table, limit: int | None, config) -> list:
        """`select` on a pairs table, under the run's `rule` setting where the population has one."""
        return self.select(table, limit, **({"rule": getattr(config, self.rule)} if self.rule else {}))


def traced_facts_under(table, limit: int | None = None, rule: str = "first-token") -> list:
    """The facts causal tracing runs on under a trace-facts rule (pairs.known.TRACE_FACTS): of the
    facts that stand alone, those trace_rejection keeps, in table order; `limit` keeps the first N."""
    kept = {r["pair_id"] for r in table.to_pylist() if r["usable_alone"] and trace_rejection(rule, r) is None}
    out = [f for f in traced_facts(table) if f.pair_id in kept]
    return out if limit is None else out[:limit]


def trace_left_out(table, rule: str) -> list[tuple[str, str, str]]:
    """(pair id, reason, detail) of every fact that stands alone and that causal tracing under `rule`
    leaves out: the record of what the rule rejected."""
    out = []
    for r in table.to_pylist():
        why = trace_rejection(rule, r) if r["usable_alone"] else None
        if why is not None:
            out.append((r["pair_id"], *why))
    return out


ACCEPTED_PAIRS = Population("accepted_pairs", accepted_pairs, "no accepted pairs in {pairs}", "pairs")
# causal tracing runs on the facts the model knows alone, partner or not (Meng et al.), by the
# run's trace_facts rule
TRACED_FACTS = Population(
    "traced_facts", traced_facts_under,
    "no fact in {pairs} that the model knows alone (its top prediction the answer): nothing to trace", "traced facts",
    shard_name="trace-shard", writes_baselines=False, asks_model=True,
    recorded=(("traced", "facts the model knows alone by the run's trace_facts rule (first-token unless recorded: "
                         "the top-1 prediction is the answer's first token, known_alone; rome: it is the whole "
                         "answer), with or without a partner"),),
    fix="leave trace out of --sweeps, or take a model that knows these facts", rule="trace_facts")

POPULATIONS = (ACCEPTED_PAIRS, TRACED_FACTS)  # in the order a study caches and shards them

# The likely fix for a data set whose records are rejected for a reason (rows.REASONS); reasons of
# one kind share their fix.
_MODEL_KNOWS_NONE = "the model knows none of these facts: try --no-require-known"
_FIELDS = "records the format cannot read: `patchgrid pairs check --pairs FILE` gives each one's reason"
REASON_FIXES = {
    "not_known_clean": _MODEL_KNOWS_NONE, "not_known_corrupt": _MODEL_KNOWS_NONE,
    "length_mismatch": "a clean and a corrupt prompt must be as many tokens long: swap subjects of equal token length",
    "differs_outside_subject": "a clean and a corrupt prompt may differ in their subject alone",
    "no_partner": "a fact needs another of its relation to swap subjects with: add facts of the same relations",
    "answer_multi_token": "an answer of several tokens: --answer-policy full scores it whole",
    "not_whole_answer": "ROME's rule traces one-token answers only: --trace-facts first-token traces the others too",
    "answer_too_long": "answers longer than the model scores: shorter answers",
    "too_long": "prompts longer than the model's context: shorter prompts",
    "same_answer": "the two facts of a pair must have different answers",
    "identical_prompts": "the two prompts of a pair must differ",
    "duplicate_id": "records share an id: give each its own",
    **dict.fromkeys(("missing_field", "bad_field", "empty_subject", "empty_answer", "subject_not_in_prompt",
                     "subject_not_found", "answer_tokenization"), _FIELDS),
}


def _left_out_by_rule(population: Population, table, config) -> tuple[str, list[str]]:
    """What a population chosen by a rule (its `rule` setting in `config`) left out, in words, and
    the reasons (most first); nothing without a config or a rule."""
    if config is None or population.rule is None:
        return "", []
    value = getattr(config, population.rule)
    counts: dict[str, int] = {}
    for _, reason, _ in trace_left_out(table, value):
        counts[reason] = counts.get(reason, 0) + 1
    reasons = sorted(counts, key=lambda r: (-counts[r], r))
    if not reasons:
        return "", []
    flag = "--" + population.rule.replace("_", "-")
    return f"; left out by {flag} {value}: " + ", ".join(f"{r} {counts[r]}" for r in reasons), reasons


def nothing_to_run(population: Population, table, pairs: str, warehouse: str, run_id: str, config=None) -> str:
    """Why a study stops on an empty population, in one line: the headline, the records accepted
    and rejected by reason (most first), with the run's sweep `config` what its rule left out
    (trace_facts: trace_left_out), the likely fixes, and the query that reads the run's
    rejections (the flow loads its pairs table before it stops)."""
    from ..pairs import summary
    from ..runtime.console import shell_command

    counts = summary(table.select(["status", "reason"]).to_pylist())
    accepted = counts.get(("accepted", None), 0)
    rejected = sorted(((n, reason) for (status, reason), n in counts.items() if status == "rejected"),
                      key=lambda c: (-c[0], c[1] or ""))
    total = accepted + sum(n for n, _ in rejected)
    by_reason = ", ".join(f"{reason} {n}" for n, reason in rejected)
    by_rule, rule_reasons = _left_out_by_rule(population, table, config)
    fixes = [population.fix] if population.fix else []
    for reason in [*rule_reasons, *(reason for _, reason in rejected)]:
        fix = REASON_FIXES.get(reason)
        if fix and fix not in fixes:
            fixes.append(fix)
    told = f"{accepted} of {total} records accepted" + (f": {by_reason}" if by_reason else "") + by_rule
    sql = f"SELECT pair_id, reason, detail FROM pairs WHERE run_id = '{run_id}' AND status = 'rejected'"
    see = "the rejections: " + shell_command("patchgrid", "query", "--warehouse", str(warehouse), sql)
    return "; ".join([f"{population.missing.format(pairs=pairs)} ({told})", *fixes[:2], see])
