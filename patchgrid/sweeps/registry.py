"""Every sweep kind, registered once: SWEEP_KINDS is the only place kinds are listed (the runner,
the flow, the spec and the report read their declarations from here).

To add a sweep kind: a `SweepKind` subclass in its own file of patchgrid/sweeps/ (sweeps.base says
what it may declare and which phases it may have, its `row_shape` among them), its entry below, and
its name in rows.SWEEP_NAMES (the effect rows' closed set of sweeps). A kind whose rows fit no shape
of rows.EFFECT_SHAPES declares a new one there (its columns), and the warehouse's views that read it.
"""
from __future__ import annotations

from ..rows.shapes import ROW_SHAPES, SWEEP_NAMES
from .atp import AtpSweep
from .base import SweepKind
from .circuit import CircuitSweep
from .edges import EdgeSweep
from .knockout import KnockoutSweep
from .paths import PathSweep
from .pattern import PatternSweep
from .populations import POPULATIONS, Population
from .position import PositionSweep
from .registered import SWEEP_KINDS
from .trace import TraceSweep
from .units import UnitSweep

SWEEP_KINDS.update((kind.name, kind) for kind in (
    PositionSweep("resid", both_directions=True),
    PositionSweep("resid_pre"),
    PositionSweep("resid_mid"),
    PositionSweep("attn_out"),
    PositionSweep("mlp_out"),
    PositionSweep("embed", layered=False),
    UnitSweep("heads", "head"),
    UnitSweep("neurons", "neuron", drawing="none"),
    UnitSweep("qkv", "q", "k", "v"),
    PatternSweep(),  # one head's attention pattern at a time
    TraceSweep(),
    AtpSweep(SWEEP_KINDS),  # screens the kinds above, by name
    PathSweep(),
    EdgeSweep(SWEEP_KINDS),  # patches its chosen edges exactly through the paths kind
    CircuitSweep(),  # builds its circuits from the edges kind's scores
    KnockoutSweep(),  # attention edges from the last position blocked
))

_unnamed = [name for name in SWEEP_KINDS if name not in SWEEP_NAMES]
if _unnamed:
    raise ImportError(f"sweep kind {_unnamed[0]!r} is not in rows.SWEEP_NAMES: its effect rows would be refused")
_unshaped = [name for name, kind in SWEEP_KINDS.items() if kind.row_shape not in ROW_SHAPES]
if _unshaped:
    raise ImportError(f"sweep kind {_unshaped[0]!r}: row shape {SWEEP_KINDS[_unshaped[0]].row_shape!r} is not one "
                      f"of rows.EFFECT_SHAPES ({', '.join(ROW_SHAPES)})")


def row_shapes() -> dict[str, str]:
    """{sweep: the shape of its effect rows} of every kind: what a load is told (warehouse.loader.load_run)."""
    return {name: kind.row_shape for name, kind in SWEEP_KINDS.items()}


def settings_of(names) -> tuple[str, ...]:
    """The SweepConfig fields the sweep kinds `names` read beyond the common ones, in order."""
    return tuple(dict.fromkeys(s for name in names for s in SWEEP_KINDS[name].settings))


def by_population(names) -> list[tuple[Population, tuple[str, ...]]]:
    """The sweep kinds `names` grouped by what a study runs them on, in the order of POPULATIONS."""
    order = list(dict.fromkeys([*POPULATIONS, *(SWEEP_KINDS[n].population for n in names)]))
    groups = [(p, tuple(n for n in names if SWEEP_KINDS[n].population is p)) for p in order]
    return [(p, group) for p, group in groups if group]


def aligning_asks_model(names) -> bool:
    """Whether choosing what the sweep kinds `names` run on needs the model's predictions."""
    return any(SWEEP_KINDS[name].population.asks_model for name in names)


def noised(names) -> bool:
    """Whether any of the sweep kinds `names` adds noise (whose std a study measures over its data set)."""
    return any(SWEEP_KINDS[name].noised for name in names)


def kind_for_site(site: str) -> SweepKind:
    """The sweep that patches `site` one run per coordinate (what `patchgrid patch` runs; qkv patches
    k and v beside q)."""
    for kind in SWEEP_KINDS.values():
        if site in kind.sites:
            return kind
    raise ValueError(f"no sweep patches site {site!r}")


def spans_data_set(names) -> bool:
    """Whether any of the sweep kinds `names` works over the run's pairs at once (a study then runs
    their group in one shard)."""
    return any(SWEEP_KINDS[name].spans_data_set for name in names)
