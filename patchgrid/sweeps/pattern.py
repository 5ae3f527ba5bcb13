"""Pattern patching (TransformerLens's get_act_patch_attn_head_pattern_*): one head's attention
pattern in the corrupt run replaced by the clean run's, the head's output recomputed as that pattern
applied to the corrupt run's own values, everything else as it is; per layer x head, at every
position at once and at the head_position_roles' positions (as the heads sweep). Beside the heads
sweep it tells a head's routing (where it reads from) from its content (what it reads there).

Patterns are not cached (their width is the heads times each prompt's length): the prepare phase
captures the clean run's patterns at the grid's layers, one run per pair over the prompt alone, and
the patched runs read them from there (ctx.derived).
"""
from __future__ import annotations

from ..cache import CacheSpec
from ..model.sites import site_key
from ..plan import Request
from .base import grid_layers
from .units import UnitSweep

CLEAN_PATTERNS = "pattern:clean"  # the run name of a pair's clean patterns (ctx.derived)


class PatternSweep(UnitSweep):
    ablatable = False
    ablatable_why = "a pattern patch takes the other run's weights; no mean or zero of a pattern is defined here"

    def __init__(self):
        super().__init__("pattern", "pattern")

    def needs(self, ctx):
        return CacheSpec((), ("clean",), super().needs(ctx).more)  # the corrupt streams to start from

    def prepare(self, ctx, run):
        """The clean prompt's patterns at the grid's layers, per pair (its answers read, scored at the
        last position alone: a pattern is read over one forward)."""
        keys = tuple(site_key("pattern", layer) for layer in grid_layers(ctx))
        derived, runs = {}, []
        for i, p in enumerate(run.pairs):
            runs.append((i, self, None, Request(tokens=p.clean_ids, answers=p.answers, capture=keys, ranks=False)))

        def read(r, res):
            derived[(run.pairs[r[0]].pair_id, CLEAN_PATTERNS)] = res.captures

        run.run(runs, read, ctx)
        return ctx.with_prepared(self.name, True, derived)

    def source_run(self, cell):
        return CLEAN_PATTERNS

