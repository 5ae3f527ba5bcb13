"""The warehouse names no sweep kind: each load records how its kinds are drawn and the shape of
their rows (warehouse/kinds.py), and the views select rows by that record and by their own columns."""
from __future__ import annotations

import pytest

from patchgrid.pairs import to_table as pairs_table
from patchgrid.rows.effects import write_effects
from patchgrid.sweeps import SWEEP_KINDS
from patchgrid.warehouse.kinds import DRAWING_SHAPES, ROW_SHAPES, row_shape
from patchgrid.warehouse.layout import Layout
from patchgrid.warehouse.loader import load_run, query, start_run
from tests.warehouse.test_views import effect, pair

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


def test_every_kind_has_a_row_shape():
    assert set(DRAWING_SHAPES.values()) <= set(ROW_SHAPES)
    shapes = {name: row_shape(kind.drawing) for name, kind in SWEEP_KINDS.items()}
    assert set(shapes.values()) == set(ROW_SHAPES)  # every shape has a kind today


def test_loads_record_their_kinds(tmp_path):
    wh = tmp_path / "w.duckdb"
    kinds = {name: kind.drawing for name, kind in SWEEP_KINDS.items()}
    load(tmp_path, wh, "r", restored("trace", "p"), kinds)
    got = query(wh, "SELECT sweep, drawing, row_shape FROM sweep_kinds WHERE run_id = 'r' ORDER BY sweep")[1]
    assert got == sorted((name, drawing, row_shape(drawing)) for name, drawing in kinds.items())
    assert query(wh, "SELECT run_id, sweep FROM noised_sweeps ORDER BY ALL")[1] == [
        ("r", name) for name, drawing in sorted(kinds.items()) if row_shape(drawing) == "noised"]


def test_the_record_decides_which_rows_are_noised(tmp_path):
    """The same rows under another sweep name are traced when their load records them as drawn by
    buckets, and not when it records them otherwise, whatever their headline metric."""
    wh = tmp_path / "w.duckdb"
    load(tmp_path, wh, "recorded", restored("resid_mid", "logit_diff"), {"resid_mid": "trace_buckets"})
    load(tmp_path, wh, "unrecorded", restored("resid_mid", "logit_diff"))
    load(tmp_path, wh, "drawn-otherwise", restored("trace", "p"), {"trace": "layer_by_role"})
    load(tmp_path, wh, "inferred", restored("trace", "p"))  # recorded nothing: on p, so noised
    got = query(wh, TRACED)[1]
    assert {run for run, *_ in got} == {"recorded", "inferred"}
    for run in ("recorded", "inferred"):
        assert [(b, n, pytest.approx(aie)) for r, b, n, aie in got if r == run] == [
            ("first_subject", 1, 0.4), ("first_subsequent", 1, 0.2), ("last", 1, 0.5), ("last_subject", 1, 0.4)]
    # a noised row stands on one fact, the clean prompt; an exact one on two
    facts = dict(query(wh, "SELECT run_id, max(n_facts) FROM effect_summary_facts GROUP BY run_id")[1])
    assert facts == {"recorded": 1, "inferred": 1, "unrecorded": 2, "drawn-otherwise": 2}


def test_a_warehouse_whose_loads_recorded_no_kinds_reads_as_before(tmp_path):
    """A warehouse written before loads recorded their kinds (no sweep_kinds file anywhere) is read
    by a reader that never writes it, the same as when its kinds are inferred."""
    wh = tmp_path / "w.duckdb"
    load(tmp_path, wh, "r", restored("trace", "p") + restored("resid", "logit_diff"))
    before = query(wh, TRACED)[1], query(wh, "SELECT * FROM effect_summary_facts ORDER BY ALL")[1]
    for f in Layout.of(wh).runs.glob("*/load=*/sweep_kinds.parquet"):
        f.unlink()
    assert (query(wh, TRACED)[1], query(wh, "SELECT * FROM effect_summary_facts ORDER BY ALL")[1]) == before
    assert query(wh, "SELECT count(*) FROM sweep_kinds")[1] == [(0,)]
    assert len(before[0]) == 4
