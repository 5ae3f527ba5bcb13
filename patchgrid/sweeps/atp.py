"""Attribution patching: every cell of the screened kinds (denoise) estimated from gradients
(patchgrid.methods.attribution), then per pair, site and scope the top K cells by the estimate and R sampled from
the rest patched exactly; one row per screened cell."""
from __future__ import annotations

import dataclasses
import random
import zlib
from collections import defaultdict

from ..cache import CacheSpec
from ..rows.effects import cell_columns, effect_row
from .base import Cell, SweepContext, SweepKind, baselines


def scope(cell: Cell) -> str:
    """Which cells a top K and a sample are taken among, and the agreement is reported over (the
    warehouse's atp views name it the same): `every_position` for a cell patched at every position
    at once (position None: the heads', neurons' and q/k/v's), `per_position` for one at one position."""
    return "every_position" if cell.position is None else "per_position"


class AtpSweep(SweepKind):
    """Attribution patching over the cells of the screened kinds (config.atp_kinds, denoise only),
    the top `verify_top` per pair, site and scope by the ranking score and `verify_random` sampled from the
    rest patched exactly. Its prepare phase makes the estimates and the choice (`estimates()`)."""
    ablatable_why = "its estimates are first order in the clean - corrupt difference"

    name, drawing, row_shape = "atp", "atp", "estimate"
    # Every atp row's metric, whatever the pair's answers: the AtP objective, the log-probability
    # difference of the answers each summed over its tokens (patchgrid.methods.attribution), which for
    # one-token answers equals the logit difference. One name for every pair, so that atp_summary
    # and effect_summary on it cover the same pairs.
    metric = "logprob_diff"
    settings = ("atp_kinds", "verify_top", "verify_random", "atp_correction", "atp_qk_fix", "atp_device", "atp_dtype")

    def __init__(self, kinds: dict[str, SweepKind]):
        self.kinds = kinds  # the kinds it may screen, by name (the registry)

    def screened(self, ctx: SweepContext) -> tuple[list[SweepKind], SweepContext]:
        """The kinds screened, and the context their grids are taken in (denoising only)."""
        config = dataclasses.replace(ctx.config, resid_directions=("denoise",))
        return [self.kinds[k] for k in ctx.config.atp_kinds], dataclasses.replace(ctx, config=config)

    def family_sites(self, config):
        return tuple(site for k in config.atp_kinds for site in self.kinds[k].family_sites(config))

    def needs(self, ctx):
        kinds, inner = self.screened(ctx)
        spec = CacheSpec(())
        for kind in kinds:
            spec = spec.merge(kind.needs(inner))
        return spec

    def prepare(self, ctx, run):
        """The estimates, on the run's attributor: an Attributor, or the options of one on the engine's
        model (attributor_for's device and dtype; none given: float32, on a GPU when there is one)."""
        from ..methods.attribution import attributor_for

        given = run.attributor
        attributor = attributor_for(run.engine, **(given or {})) if given is None or isinstance(given, dict) else given
        return ctx.with_prepared(self.name, self.estimates(attributor, run.pairs, ctx))

    def grid(self, pair, ctx) -> list[Cell]:
        """Every screened cell, as an atp cell, in grid order."""
        if ctx.prepared_by(self.name) is not None:
            return list(ctx.prepared_by(self.name)[pair.pair_id])
        kinds, inner = self.screened(ctx)
        return [Cell(self.name, c.site, c.direction, c.layer, c.position, c.head, c.window, c.sample, c.neuron)
                for kind in kinds for c in kind.cells(pair, inner)]

    def estimates(self, attributor, pairs, ctx) -> dict[str, dict[Cell, tuple[float, float | None, str | None]]]:
        """Per pair id, every screened cell's (estimate, GradDrop score or None, why it is patched
        exactly: `top`, `random` or None), in grid order."""
        kinds, _ = self.screened(ctx)
        sites = tuple(dict.fromkeys(site for kind in kinds for site in kind.sites))  # qkv: q, k and v
        got = attributor.estimate(pairs, sites, ctx.config.atp_correction, qk_fix=ctx.config.atp_qk_fix)
        out = {}
        for pair, est in zip(pairs, got):
            n = len(pair.corrupt_ids)
            values = {site: {k: v.tolist() for k, v in e.items()} for site, e in est.items()}
            cells = {}
            for cell in self.grid(pair, ctx):
                e = values[cell.site]
                pos = n if cell.position is None else cell.position
                unit = cell.head if cell.head is not None else cell.neuron or 0
                gd = e["graddrop"][cell.layer][pos][unit] if "graddrop" in e else None
                cells[cell] = (e["estimate"][cell.layer][pos][unit], gd)
            chosen = self.verified(pair, cells, ctx.config)
            out[pair.pair_id] = {cell: (est_, gd, chosen.get(cell)) for cell, (est_, gd) in cells.items()}
        return out

    @staticmethod
    def verified(pair, cells: dict, config) -> dict[Cell, str]:
        """The cells patched exactly: per screened site and scope (a cell at every position at once,
        position None, apart from those at one position: `scope`), the top K by the ranking score
        (|estimate|, or the GradDrop score), then R sampled (seeded by the study seed, the pair, the
        site and the scope) from the rest; cell -> `top` or `random`."""
        by_group = defaultdict(list)
        for cell in cells:
            by_group[(cell.site, scope(cell))].append(cell)
        graddrop = config.atp_correction == "graddrop"
        out = {}
        for (site, where), group in by_group.items():
            ranked = sorted(group, key=lambda c: -(cells[c][1] if graddrop else abs(cells[c][0])))  # stable
            top, rest = ranked[:config.verify_top], ranked[config.verify_top:]
            rng = random.Random(zlib.crc32(f"{config.seed}:{pair.pair_id}:{site}:{where}".encode()))
            out.update({c: "top" for c in top})
            out.update({c: "random" for c in rng.sample(rest, min(config.verify_random, len(rest)))})
        return out

    def cells(self, pair, ctx):
        estimates = ctx.prepared_by(self.name)
        if estimates is None:
            raise ValueError("the atp sweep's cells depend on its estimates: compute them first (AtpSweep.prepare)")
        return [cell for cell, (_, _, verify) in estimates[pair.pair_id].items() if verify is not None]

    def count(self, pair, ctx):
        kinds, inner = self.screened(ctx)
        k, r = ctx.config.verify_top, ctx.config.verify_random
        sizes = defaultdict(int)  # cells per (site, scope), as verified() groups them
        for kind in kinds:
            for c in kind.cells(pair, inner):
                sizes[(c.site, scope(c))] += 1
        return sum(min(k + r, n) for n in sizes.values())

    def request(self, pair, cell, ctx, source):
        kinds, inner = self.screened(ctx)
        kind = next(k for k in kinds if cell.site in k.sites)
        return kind.request(pair, cell, inner, source)

    def rows(self, pair, readings, baseline, ctx):
        clean, corrupt = baselines(baseline)
        metric = self.headline(pair)
        exact = dict(readings)
        out, unpatched = [], None  # the columns every site not patched shares: baselines, NULL patched run
        for cell, (estimate, graddrop, verify) in ctx.prepared_by(self.name)[pair.pair_id].items():
            if cell in exact:
                row = effect_row(pair, cell, exact[cell], clean, corrupt, metric)
            else:
                if unpatched is None:
                    unpatched = effect_row(pair, cell, None, clean, corrupt, metric)
                row = {**unpatched, **cell_columns(pair, cell)}
            row.update(estimate=estimate, estimate_graddrop=graddrop, verify=verify)
            out.append(row)
        return out
