"""Synthetic effect rows in today's shape, made by `patchgrid.rows.effects.effect_row` from
`patchgrid.metrics.Reading`s, so that warehouse and report tests follow the one definition of a
row (which metrics it carries, which run an effect is measured from)."""
from __future__ import annotations

from dataclasses import fields

import pyarrow.parquet as pq

from patchgrid.metrics import METRICS, Reading
from patchgrid.pairs.pair import Pair
from patchgrid.rows.effects import effect_row, write_effects
from patchgrid.sweeps import Cell

# A pair's two baselines on every metric: the clean run knows its answer (kl 0, rank 0), the
# corrupt run prefers the other one. Every span, in its metric's direction, is above min_span.
CLEAN = Reading(logit_diff=2.0, logprob_diff=2.5, logp_clean=-0.5, logp_corrupt=-3.0, p=0.6, kl=0.0, rank=0.0)
CORRUPT = Reading(logit_diff=-2.0, logprob_diff=-2.5, logp_clean=-3.0, logp_corrupt=-0.5, p=0.05, kl=2.0, rank=6.0)


def between(r: float, clean: Reading = CLEAN, corrupt: Reading = CORRUPT, **values) -> Reading:
    """The reading a fraction `r` of the way from `corrupt` to `clean` on every metric (r is the
    recovery on each; None where either baseline has none), with `values` set as given."""
    out = {}
    for name in METRICS:
        a, b = clean.value(name), corrupt.value(name)
        out[name] = None if a is None or b is None else b + r * (a - b)
    return Reading(**{**out, **values})


def shifted(reading: Reading, **change) -> Reading:
    return Reading(**{f.name: getattr(reading, f.name) for f in fields(Reading)} | change)


def make_pair(pair_id: str, roles, relation: str | None = "r", subject=(0, 1)) -> Pair:
    n = len(roles)
    return Pair(pair_id, relation, tuple(range(n)), tuple(range(n)), (1,), (2,), subject[0], subject[1], tuple(roles))


def row(pair: Pair, r: float, *, sweep="resid", site="resid", direction="denoise", layer=0, position=None,
        head=None, window=None, metric="logit_diff", clean: Reading = CLEAN, corrupt: Reading = CORRUPT,
        patched: Reading | None = None, neuron=None, receiver: str | None = None) -> dict:
    """One effect row of `pair` at a cell, patched `r` of the way from corrupt to clean (or as
    `patched`); position None with position_role `all` as the sweeps write it; `receiver`: a
    paths row (its sender named from site, layer and head)."""
    cell = Cell(sweep, site, direction, layer, position, head, window, neuron=neuron, receiver=receiver)
    return effect_row(pair, cell, patched or between(r, clean, corrupt), clean, corrupt, metric)


def atp_row(pair: Pair, estimate: float, *, site="resid", layer=0, position=None, head=None, neuron=None,
            verify=None, r: float | None = None, graddrop: float | None = None, metric="logit_diff",
            clean: Reading = CLEAN, corrupt: Reading = CORRUPT) -> dict:
    """One atp row of `pair` (sweep atp, direction denoise): the estimate and GradDrop score; with
    `verify` ('top' or 'random'), also patched exactly `r` of the way from corrupt to clean."""
    if (verify is None) != (r is None):
        raise ValueError("a verified atp row, and only one, has its exact recovery r")
    cell = Cell("atp", site, "denoise", layer, position, head, neuron=neuron)
    patched = None if verify is None else between(r, clean, corrupt)
    out = effect_row(pair, cell, patched, clean, corrupt, metric)
    return out | {"estimate": estimate, "estimate_graddrop": graddrop, "verify": verify}


def baseline(pair_id: str, clean: Reading = CLEAN, corrupt: Reading = CORRUPT) -> dict:
    """The pair's rows.BASELINE row."""
    out = {"pair_id": pair_id}
    for prefix, reading in (("clean", clean), ("corrupt", corrupt)):
        out.update({f"{prefix}_{f.name}": getattr(reading, f.name) for f in fields(Reading)})
    return out


def write_and_read_back(rows: list[dict], path) -> tuple:
    """Rows written as the sweeps write them, and read back: the float32 values the warehouse holds."""
    f = write_effects(rows, path)
    return f, pq.read_table(f).to_pylist()
