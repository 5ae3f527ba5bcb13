"""The warehouse names no sweep kind: each kind declares the shape of its rows (SweepKind.row_shape),
a load files each row under its sweep's shape with that shape's columns only (warehouse/kinds.py),
records the shape of each sweep it holds, and the views select rows by their shape."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from patchgrid.pairs import to_table as pairs_table
from patchgrid.rows.effects import write_effects
from patchgrid.rows.shapes import EFFECT, EFFECT_SHAPES, ROW_SHAPES, RowError
from patchgrid.sweeps import SWEEP_KINDS
from patchgrid.sweeps.registry import row_shapes
from patchgrid.warehouse.layout import Layout
from patchgrid.warehouse.loader import load_run, query, start_run
from tests.support.effect_rows import atp_row, make_pair
from tests.unit.warehouse.test_views import effect, pair

ROLES = ("subject_last", "after_subject", "last")
TRACED = "SELECT run_id, bucket, n_tokens, aie FROM trace_buckets WHERE site = 'resid' AND metric = 'p' ORDER BY ALL"


def restored(sweep, metric, pid="one"):
    """Rows restoring p(answer) from 0.1 at each position (as causal tracing's), of `sweep` on `metric`."""
    return [effect(pid, 0, roles=ROLES, position=pos, sweep=sweep, metric=metric, p=p, noised_p=0.1)
            for pos, p in enumerate((0.5, 0.3, 0.6))]


def load(tmp_path, wh, run_id, rows, sweep_kinds=None):
    start_run(wh, {"run_id": run_id, "model": "m"})
    f = write_effects(rows, tmp_path / f"{run_id}.parquet")
    load_run(wh, run_id, pairs_table([pair("one", roles=ROLES)]), [], [f], sweep_kinds=sweep_kinds)


def test_every_kind_declares_a_row_shape_and_every_shape_has_a_kind():
    assert row_shapes() == {name: kind.row_shape for name, kind in SWEEP_KINDS.items()}
    assert set(row_shapes().values()) == set(ROW_SHAPES)
    assert {name: shape for name, shape in row_shapes().items() if shape != "exact"} == {
        "trace": "noised", "atp": "estimate", "paths": "path", "edges": "edge", "circuit": "circuit",
        "knockout": "knockout"}


def test_each_shape_has_the_columns_its_rows_need_and_no_other():
    every = {"pair_id", "sweep", "site", "direction", "layer", "position", "metric", "effect", "recovery"}
    assert all(every <= set(shape.columns) for shape in EFFECT_SHAPES.values())
    own = {name: [c for c in shape.columns if c not in EFFECT_SHAPES["exact"].columns or c == "ablation"]
           for name, shape in EFFECT_SHAPES.items()}
    assert own == {"exact": ["ablation"], "estimate": ["estimate", "estimate_graddrop", "verify"],
                   "path": ["sender", "receiver"], "noised": ["window"],
                   "edge": ["sender", "receiver", "estimate", "verify", "circuit_rank"],
                   "circuit": ["circuit_size", "circuit_edges", "ablation"], "knockout": ["window", "blocked"]}
    assert set().union(*(shape.columns for shape in EFFECT_SHAPES.values())) == set(EFFECT.columns)


def test_a_load_files_each_shape_apart_with_its_columns_only_and_records_its_sweeps(tmp_path):
    wh = tmp_path / "w.duckdb"
    key = make_pair("one", ROLES)
    rows = restored("trace", "p") + restored("resid", "logit_diff") + [atp_row(key, 0.5, layer=0)]
    load(tmp_path, wh, "r", rows, row_shapes())
    (load_dir,) = Layout.of(wh).loads("r")
    files = {f.parent.name: pq.read_schema(f).names for f in (load_dir / "effects").glob("*/*.parquet")}
    assert files == {f"row_shape={s}": EFFECT_SHAPES[s].columns for s in ("exact", "noised", "estimate")}
    assert query(wh, "SELECT sweep, row_shape FROM sweep_kinds WHERE run_id = 'r' ORDER BY sweep")[1] == [
        ("atp", "estimate"), ("resid", "exact"), ("trace", "noised")]
    assert query(wh, "SELECT row_shape, count(*), count(estimate), count(\"window\") FROM effects "
                     "WHERE run_id = 'r' GROUP BY ALL ORDER BY ALL")[1] == [
        ("estimate", 1, 1, 0), ("exact", 3, 0, 0), ("noised", 3, 0, 0)]
    assert query(wh, "SELECT run_id, sweep FROM noised_sweeps")[1] == [("r", "trace")]


def test_the_declared_shape_decides_which_rows_are_noised(tmp_path):
    """The same rows under another sweep name are traced when their sweep's shape is noised, and not
    when it is not, whatever their headline metric."""
    wh = tmp_path / "w.duckdb"
    load(tmp_path, wh, "declared", restored("resid_mid", "logit_diff"), {"resid_mid": "noised"})
    load(tmp_path, wh, "undeclared", restored("resid_mid", "logit_diff"))  # a sweep not named: exact
    load(tmp_path, wh, "declared-otherwise", restored("trace", "p"), {"trace": "exact"})
    load(tmp_path, wh, "traced", restored("trace", "p"), row_shapes())
    got = query(wh, TRACED)[1]
    assert {run for run, *_ in got} == {"declared", "traced"}
    for run in ("declared", "traced"):
        assert [(b, n, pytest.approx(aie)) for r, b, n, aie in got if r == run] == [
            ("first_subject", 1, 0.4), ("first_subsequent", 1, 0.2), ("last", 1, 0.5), ("last_subject", 1, 0.4)]
    # a noised row stands on one fact, the clean prompt; an exact one on two
    facts = dict(query(wh, "SELECT run_id, max(n_facts) FROM effect_summary_facts GROUP BY run_id")[1])
    assert facts == {"declared": 1, "traced": 1, "undeclared": 2, "declared-otherwise": 2}


def test_rows_setting_a_column_their_shape_has_not_are_refused(tmp_path):
    """An attribution-patching row filed as exact (its kind's shape not told) would reach the effect
    views: the load refuses it, and leaves the warehouse as it was."""
    wh = tmp_path / "w.duckdb"
    rows = restored("resid", "logit_diff") + [atp_row(make_pair("one", ROLES), 0.5, layer=0)]
    with pytest.raises(RowError, match="sweep 'atp': estimate is set, and their shape, exact, has no such column"):
        load(tmp_path, wh, "r", rows)
    with pytest.raises(RowError, match="row_shape 'layer_by_role' is not one of exact, estimate"):
        load(tmp_path, wh, "r", rows, {"atp": "layer_by_role"})  # how the report draws it is no shape
    assert query(wh, "SELECT count(*) FROM effects")[1] == [(0,)]
