"""Every row shape patchgrid writes, defined once as an Arrow schema.

The sweeps produce effect rows in `EFFECT`, the pairs step writes `PAIR`, the activation cache
keeps `BASELINE`, a study records `RUN`. Parquet staging files use these schemas, and the
warehouse's views (generated from these shapes by warehouse/catalog.py) give `run_id` and then
exactly these columns (the warehouse keeps `PAIR_IN_WAREHOUSE`, a subset of `PAIR`, and files effect
rows by their shape, `EFFECT_SHAPES`, each shape with its own columns only); a test checks them
column for column, type for type.

Columns with a closed set of values are checked whenever rows are turned into a table, so an
unknown sweep, site or status never reaches a file.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from ..metrics import METRICS
from ..model.sites import SITE_KINDS

# Meng et al.'s token roles, plus `before_subject` for tokens that precede the subject (their
# plots leave those out; averaging them into `further` would dilute it with zeros).
ROLES = ("before_subject", "subject_first", "subject_middle", "subject_last", "after_subject", "further", "last")
# single: both answers are one token; full: an answer of several tokens, scored whole (teacher-forced);
# first-token: an answer of several tokens cut to its first
ANSWER_POLICIES = ("single", "full", "first-token")
STATUSES = ("accepted", "rejected")
# Why a record was rejected: read errors, alignment, pairing and the model's knowledge.
REASONS = (
    "missing_field", "bad_field", "empty_subject", "empty_answer", "subject_not_in_prompt", "duplicate_id",
    "subject_not_found", "answer_multi_token", "answer_too_long", "answer_tokenization", "too_long", "length_mismatch",
    "differs_outside_subject",
    "identical_prompts", "same_answer", "no_partner", "not_known_clean", "not_known_corrupt", "limit_reached",
    # why causal tracing leaves a fact out (pairs.known.trace_rejection, by the run's trace_facts rule)
    "not_known_alone", "not_whole_answer",
)
# The sweep kinds (patchgrid.sweeps.registry registers a kind by each name, in this order)
SWEEP_NAMES = ("resid", "resid_pre", "resid_mid", "attn_out", "mlp_out", "embed", "heads", "neurons", "qkv",
               "pattern", "trace", "atp", "paths", "edges", "circuit", "knockout")
DIRECTIONS = ("denoise", "noise")  # a patch's: clean into corrupt | corrupt into clean
# An attention knockout's rows (sweeps.knockout): their direction and site name it, the clean run with
# the last position's attention edges to a group of positions blocked
KNOCKOUT_DIRECTION, KNOCKOUT_SITE = "knockout", "attention_edges"
# Each direction an effect row may have -> the run its own run equals below its intervention, which
# its effect is measured from
BASE_RUNS = {"denoise": "corrupt", "noise": "clean", KNOCKOUT_DIRECTION: "clean"}
VERIFY = ("top", "random")  # why an atp row's site was patched exactly
# What a patch (or an edge outside a circuit) gets: the other run's value, the data set's mean at
# that site and position role, or zero (sweeps.config's `ablation`)
ABLATIONS = ("patching", "mean", "zero")
# the positions a knockout blocks the last position from reading (sweeps.knockout)
KNOCKOUT_GROUPS = ("subject", "non_subject", "last")
POSITION_ROLES = ROLES + ("all",)  # `all`: a patch over every position at once
RUN_STATUSES = ("running", "completed", "failed", "cancelled")  # cancelled: SIGTERM or SIGINT


class RowError(ValueError):
    """Rows that do not fit their shape; the message names the column and the value."""


@dataclass(frozen=True)
class RowShape:
    name: str
    schema: pa.Schema
    closed: dict[str, tuple[str, ...]] = field(default_factory=dict)  # column -> its allowed values

    @property
    def columns(self) -> list[str]:
        return self.schema.names

    def table(self, rows: list[dict]) -> pa.Table:
        """Rows as an Arrow table in this shape; missing keys are NULL, closed columns checked, and a
        key the shape does not have is refused (Arrow would drop it silently)."""
        unknown = set().union(*rows) - set(self.schema.names) if rows else set()
        if unknown:
            raise RowError(f"{self.name} rows: {sorted(unknown)[0]!r} is not a column of this shape")
        table = pa.Table.from_pylist(rows, schema=self.schema)
        self.check(table)
        return table

    def check(self, table: pa.Table, columns=None) -> None:
        """Refuse a value outside its closed set in any of `columns` (default: all closed ones)."""
        for column in self.closed if columns is None else columns:
            allowed = self.closed[column]
            values = table.column(column)
            ok = pc.or_(pc.is_in(values, pa.array(allowed, pa.string())), pc.is_null(values))
            bad = pc.filter(values, pc.invert(ok))
            if len(bad):
                raise RowError(f"{self.name} rows: {column} {bad[0].as_py()!r} is not one of {', '.join(allowed)}")

    def select(self, name: str, columns: list[str]) -> RowShape:
        """The same shape restricted to `columns`, in that order."""
        return RowShape(name, pa.schema([self.schema.field(c) for c in columns]),
                        {c: v for c, v in self.closed.items() if c in columns})


def _metric_columns(prefixes) -> list[tuple[str, pa.DataType]]:
    """Each metric's value under each prefix (`patched_logit_diff`, `clean_kl`, ...), and each
    answer's log-probability per token."""
    cols = [(f"{prefix}_{m}", pa.float32()) for prefix in prefixes for m in METRICS]
    cols += [(f"{prefix}_{what}_tokens", pa.list_(pa.float32())) for prefix in prefixes
             for what in ("logp_clean", "logp_corrupt")]
    return cols


EFFECT = RowShape("effect", pa.schema([
    ("pair_id", pa.string()),
    ("relation", pa.string()),
    ("sweep", pa.string()),
    ("site", pa.string()),
    ("direction", pa.string()),
    ("layer", pa.int32()),  # the window's centre for windowed trace rows; NULL for embed
    ("position", pa.int32()),  # NULL: every position at once
    ("position_role", pa.string()),  # a pairs-table role, or `all`
    ("head", pa.int32()),
    ("neuron", pa.int32()),
    ("window", pa.int32()),
    # paths: the path's two ends (sites.unit_name): the sender, whose clean output is patched in
    # (also given by site, layer and head), and the receiver: `logits`, or a later head's input
    # (`q.5.1`, `k.5.0`, `v.5.0`; k and v by key/value head); NULL for every other sweep
    ("sender", pa.string()),
    ("receiver", pa.string()),
    # knockout: the group of positions the last position could not read (subject, non_subject, last);
    # NULL for every other sweep
    ("blocked", pa.string()),
    ("metric", pa.string()),  # the sweep's headline metric, which `effect` and `recovery` are on
    ("effect", pa.float32()),  # NULL for an atp row whose site was not verified (patched) exactly
    ("recovery", pa.float32()),
    # atp: the attribution-patching estimate of `effect` (signed), and AtP*'s GradDrop score
    # (unsigned, for ranking; NULL unless asked for); `verify` says why the site was also
    # patched exactly: `top` (among the top K by the ranking score) or `random` (sampled from the rest)
    ("estimate", pa.float32()),
    ("estimate_graddrop", pa.float32()),
    ("verify", pa.string()),
    # circuit: the circuit's size in percent of the graph's edges (0: the empty circuit) and its number
    # of edges; edges: the edge's place in the order the run's circuits take edges in (a circuit of n
    # edges holds those ranked below n); NULL elsewhere
    ("circuit_size", pa.float32()),
    ("circuit_edges", pa.int32()),
    ("circuit_rank", pa.int32()),
    # what the patch (an edge outside the circuit) got: patching, mean or zero; NULL: patching, the
    # other run's value (rows of kinds that take no other, and rows written before it was recorded)
    ("ablation", pa.string()),
    # every metric of the patched run and the pair's baselines (trace: corrupt is the noised run's)
    *_metric_columns(("patched", "clean", "corrupt")),
]), {"sweep": SWEEP_NAMES, "site": SITE_KINDS + (KNOCKOUT_SITE,), "direction": tuple(BASE_RUNS),
     "metric": tuple(METRICS), "position_role": POSITION_ROLES, "verify": VERIFY, "ablation": ABLATIONS,
     "blocked": KNOCKOUT_GROUPS})

# The columns every effect row has, whatever its shape: which pair and cell it is, its headline metric's
# effect and recovery, and every reading of the patched run and the pair's baselines.
_EVERY_EFFECT_ROW = ("pair_id", "relation", "sweep", "site", "direction", "layer", "position", "position_role",
                     "head", "neuron", "metric", "effect", "recovery",
                     *(name for name, _ in _metric_columns(("patched", "clean", "corrupt"))))


def _effect_shape(name: str, *own: str) -> RowShape:
    """The effect rows of one shape: the columns every effect row has and its `own`, in EFFECT's order."""
    unknown = [c for c in own if c not in EFFECT.columns]
    if unknown:
        raise ValueError(f"effect row shape {name!r}: {unknown[0]!r} is not a column of EFFECT")
    return EFFECT.select(name, [c for c in EFFECT.columns if c in _EVERY_EFFECT_ROW or c in own])


# Each sweep kind's rows have one of these shapes (SweepKind.row_shape), with exactly its columns: the
# warehouse files each shape apart and its views select rows by shape (warehouse/kinds.py).
EFFECT_SHAPES = {shape.name: shape for shape in (
    # one patched run per row, its effect its own (every kind's that declares no other)
    _effect_shape("exact", "ablation"),
    # attribution patching: an estimate per site, only a selected subset also patched exactly (`verify`)
    _effect_shape("estimate", "estimate", "estimate_graddrop", "verify"),
    # path patching: one path from a sender to a receiver per row
    _effect_shape("path", "sender", "receiver"),
    # causal tracing: the clean prompt noised, one site restored per row (`corrupt_*`: the noised run's)
    _effect_shape("noised", "window"),
    # edge attribution: one edge's score per row, a selected subset also patched exactly (`verify`)
    _effect_shape("edge", "sender", "receiver", "estimate", "verify", "circuit_rank"),
    # circuits: one circuit run of a pair per row
    _effect_shape("circuit", "circuit_size", "circuit_edges", "ablation"),
    # attention knockout: one group of positions blocked from the last over a window of layers per row
    _effect_shape("knockout", "window", "blocked"),
)}
ROW_SHAPES = tuple(EFFECT_SHAPES)

PAIR = RowShape("pair", pa.schema([
    ("pair_id", pa.string()),
    ("source_line", pa.int64()),
    ("relation", pa.string()),
    ("status", pa.string()),
    ("reason", pa.string()),  # a reason code when rejected
    ("detail", pa.string()),  # the reason in words
    ("subject", pa.string()),
    ("corrupt_subject", pa.string()),
    ("clean_prompt", pa.string()),
    ("corrupt_prompt", pa.string()),
    ("clean_answer", pa.string()),
    ("corrupt_answer", pa.string()),
    ("clean_ids", pa.list_(pa.int32())),
    ("corrupt_ids", pa.list_(pa.int32())),
    ("clean_answer_id", pa.int32()),  # the answer's first token
    ("corrupt_answer_id", pa.int32()),
    ("clean_answer_ids", pa.list_(pa.int32())),  # every token scored (one under single and first-token)
    ("corrupt_answer_ids", pa.list_(pa.int32())),
    ("answer_policy", pa.string()),
    ("subject_start", pa.int32()),
    ("subject_end", pa.int32()),  # exclusive
    ("roles", pa.list_(pa.string())),  # one per position
    ("clean_logit_diff", pa.float32()),  # set when the model is asked; one-token answers only
    ("corrupt_logit_diff", pa.float32()),
    # log p(clean answer) - log p(corrupt answer), each summed over its tokens, on the clean and the
    # corrupt prompt: what --require-known judges by; set for every pair the model is asked about
    ("clean_logprob_diff", pa.float32()),
    ("corrupt_logprob_diff", pa.float32()),
    ("usable_alone", pa.bool_()),  # the clean fact alone passes, for causal tracing
    ("known_alone", pa.bool_()),  # the model's top token on the clean prompt is the answer
]), {"status": STATUSES, "reason": REASONS, "answer_policy": ANSWER_POLICIES})

# What the warehouse keeps of each input record (token ids stay in the run's pairs table).
PAIR_IN_WAREHOUSE = PAIR.select("pair", [
    "pair_id", "relation", "clean_prompt", "corrupt_prompt", "clean_answer", "corrupt_answer", "status", "reason",
    "detail", "subject", "subject_start", "subject_end", "roles", "known_alone", "answer_policy",
])

BASELINE = RowShape("baseline", pa.schema([
    ("pair_id", pa.string()),
    *_metric_columns(("clean", "corrupt")),
]))

RUN = RowShape("run", pa.schema([
    ("run_id", pa.string()),
    ("flow_run_id", pa.string()),
    ("model", pa.string()),
    ("model_hash", pa.string()),
    pa.field("params", pa.string(), metadata={"sql": "JSON"}),
    ("code_version", pa.string()),
    ("started", pa.timestamp("us")),
    ("finished", pa.timestamp("us")),
    ("status", pa.string()),
    ("reason", pa.string()),  # why a run failed or was cancelled, in one line
]), {"status": RUN_STATUSES})

# The warehouse's effect rows: every shape's columns, and the row's shape (NULL where a row's shape
# does not have a column)
EFFECT_IN_WAREHOUSE = RowShape("effect", EFFECT.schema.append(pa.field("row_shape", pa.string())),
                               {**EFFECT.closed, "row_shape": ROW_SHAPES})

# warehouse table -> the shape of its rows after `run_id` (runs: the whole row)
WAREHOUSE_TABLES = {"runs": RUN, "pairs": PAIR_IN_WAREHOUSE, "baselines": BASELINE, "effects": EFFECT_IN_WAREHOUSE}

_SQL_TYPES = {pa.string(): "VARCHAR", pa.int32(): "INTEGER", pa.int64(): "BIGINT", pa.float32(): "FLOAT",
              pa.float64(): "DOUBLE", pa.bool_(): "BOOLEAN", pa.timestamp("us"): "TIMESTAMP",
              pa.list_(pa.string()): "VARCHAR[]", pa.list_(pa.int32()): "INTEGER[]",
              pa.list_(pa.float32()): "FLOAT[]"}


def sql_type(f: pa.Field) -> str:
    """The DuckDB type a warehouse column of this field declares."""
    if f.metadata and b"sql" in f.metadata:
        return f.metadata[b"sql"].decode()
    return _SQL_TYPES[f.type]
