"""patchgrid.pipeline.summary on a small warehouse of hand-built rows: the records and rejections, the sweeps'
patched runs, the strongest cells of each sweep with their interval, the time and the commands."""
from __future__ import annotations

import json
import math
import statistics
from datetime import datetime

import pytest

from patchgrid.pairs import to_table as pairs_table
from patchgrid.pipeline.summary import cell_name, commands, study_summary
from patchgrid.rows.effects import write_effects
from patchgrid.sweeps.registry import row_shapes
from patchgrid.warehouse.loader import load_run, start_run
from tests.support.effect_rows import atp_row, make_pair, row

ROLES = ("subject_last", "last")


def pair(pid, status="accepted", reason=None):
    return {"pair_id": pid, "relation": "r", "status": status, "reason": reason, "clean_prompt": f"c{pid}",
            "corrupt_prompt": f"x{pid}", "roles": list(ROLES), "subject_start": 0, "subject_end": 1}


@pytest.fixture
def warehouse(tmp_path):
    wh = tmp_path / "w.duckdb"
    pairs = [pair(f"p{i}") for i in range(3)] + [pair("q0", "rejected", "length_mismatch"),
                                                  pair("q1", "rejected", "length_mismatch"),
                                                  pair("q2", "rejected", "not_known_clean"),
                                                  pair("q3", "rejected", "limit_reached")]  # never judged
    effects = []
    for i, p in enumerate(make_pair(f"p{i}", ROLES) for i in range(3)):
        for layer, r in ((0, 0.1), (1, 0.5 + 0.1 * i), (2, 0.9)):
            effects.append(row(p, r, layer=layer, position=1))
        if i == 0:  # a cell of one pair, no interval: after the cells of three, however strong
            effects.append(row(p, 1.0, layer=3, position=1))
        # corrupt into clean: its own ranking, by 1 - recovery (recovery 1: the patch changed nothing)
        for layer, r in ((0, 0.3), (1, 0.95), (2, 0.1)):
            effects.append(row(p, r, direction="noise", layer=layer, position=1))
        effects.append(row(p, 0.2, sweep="mlp_out", site="mlp_out", layer=0, position=0))
        # attribution patching: one site estimated and verified, one estimated only
        effects.append(atp_row(p, 0.5, layer=0, verify="top", r=0.7))
        effects.append(atp_row(p, 0.1, layer=1))
    start_run(wh, {"run_id": "r", "model": "m", "started": datetime(2026, 1, 1, 12, 0, 0)})
    load_run(wh, "r", pairs_table(pairs), [], [write_effects(effects, tmp_path / "e.parquet")],
             finished=datetime(2026, 1, 1, 12, 0, 41, 500000), sweep_kinds=row_shapes())
    return wh


def test_the_summary_counts_records_sweeps_and_time(warehouse):
    s = study_summary(warehouse, "r")
    # a record the judging never reached (the limit) is neither accepted nor rejected: counted apart
    assert s["records"] == {"read": 7, "accepted": 3, "rejected": 3, "not_judged": 1,
                            "rejected_by_reason": {"length_mismatch": 2, "not_known_clean": 1}}
    assert list(s["records"]["rejected_by_reason"]) == ["length_mismatch", "not_known_clean"]  # most first
    assert s["sweeps"] == [{"sweep": "atp", "pairs": 3, "effect_rows": 6, "patched_runs": 3},
                           {"sweep": "mlp_out", "pairs": 3, "effect_rows": 3, "patched_runs": 3},
                           {"sweep": "resid", "pairs": 3, "effect_rows": 19, "patched_runs": 19}]
    assert (s["status"], s["model"], s["seconds"]) == ("completed", "m", 41.5)
    json.dumps(s)  # --json prints it as it is


def test_the_strongest_cells_of_each_sweep_with_their_interval(warehouse):
    strongest = study_summary(warehouse, "r", per_sweep=2)["strongest"]
    resid = [c for c in strongest if c["sweep"] == "resid" and c["direction"] == "denoise"]
    assert [(c["layer"], c["position_role"]) for c in resid] == [(2, "last"), (1, "last")]
    values = [0.5, 0.6, 0.7]
    se = statistics.stdev(values) / math.sqrt(3)
    second = resid[1]
    assert (second["metric"], second["mean_of"], second["n_pairs"]) == ("logit_diff", "recovery", 3)
    assert second["mean"] == pytest.approx(0.6, abs=1e-5)
    assert second["ci95_low"] == pytest.approx(0.6 - 4.3027 * se, abs=1e-4)
    assert second["ci95_high"] == pytest.approx(0.6 + 4.3027 * se, abs=1e-4)
    assert second["cell"] == "resid L1 last"
    every = study_summary(warehouse, "r", per_sweep=4)["strongest"]
    assert [(c["layer"], c["n_pairs"]) for c in every if c["sweep"] == "resid" and c["direction"] == "denoise"] == [
        (2, 3), (1, 3), (0, 3), (3, 1)]
    # attribution patching's rows are in atp's own views, not effect_summary's
    others = [(c["sweep"], c["direction"], c["layer"], round(c["mean"], 4), c["ranked_by"]) for c in strongest
              if c not in resid]
    assert others == [("mlp_out", "denoise", 0, 0.2, "recovery"), ("resid", "noise", 2, 0.1, "1 - recovery"),
                      ("resid", "noise", 0, 0.3, "1 - recovery")]
    assert {c["ranked_by"] for c in resid} == {"recovery"}


def test_cell_names():
    assert cell_name({"site": "head", "layer": 2, "head": 1, "position_role": "subject_last",
                      "direction": "denoise"}) == "head L2.1 subject_last"
    assert cell_name({"site": "head", "layer": 1, "head": 0, "receiver": "logits", "position_role": None,
                      "direction": "denoise"}) == "head L1.0 -> logits all"
    assert cell_name({"site": "resid", "layer": 0, "position_role": "last", "direction": "noise"}) == \
        "resid L0 last (noise)"


def test_the_commands_quote_what_the_shell_would_split(tmp_path):
    wh = tmp_path / "my runs" / "w.duckdb"
    c = commands(wh, "run-abc")
    assert c["report"] == f'patchgrid report --warehouse "{wh}" --run run-abc --out report'
    assert c["query"].startswith(f'patchgrid query --warehouse "{wh}" "SELECT * FROM effect_summary WHERE run_id = '
                                 f"'run-abc' AND direction = 'denoise' ORDER BY mean_recovery DESC")


def test_an_unknown_run_is_named(warehouse):
    with pytest.raises(ValueError, match="no run nope"):
        study_summary(warehouse, "nope")


def test_a_study_with_nothing_to_run_says_why_in_one_line():
    """The line a study stops with when no pair is accepted: counts by reason (most first), the
    likely fixes, and the query that reads the run's rejections."""
    from patchgrid.sweeps.populations import ACCEPTED_PAIRS, TRACED_FACTS, nothing_to_run

    table = pairs_table([pair("a", "rejected", "not_known_clean"), pair("b", "rejected", "not_known_corrupt"),
                         pair("c", "rejected", "not_known_clean"), pair("d", "rejected", "no_partner")])
    line = nothing_to_run(ACCEPTED_PAIRS, table, "f.jsonl", "w.duckdb", "run-1")
    assert line == ("no accepted pairs in f.jsonl (0 of 4 records accepted: not_known_clean 2, no_partner 1, "
                    "not_known_corrupt 1); the model knows none of these facts: try --no-require-known; a fact needs "
                    "another of its relation to swap subjects with: add facts of the same relations; the rejections: "
                    "patchgrid query --warehouse w.duckdb \"SELECT pair_id, reason, detail FROM pairs WHERE run_id = "
                    "'run-1' AND status = 'rejected'\"")
    traced = nothing_to_run(TRACED_FACTS, pairs_table([pair("a"), pair("b", "rejected", "length_mismatch")]),
                            "f.jsonl", "w.duckdb", "run-1")
    assert traced.startswith("no fact in f.jsonl that the model knows alone (its top prediction the answer): nothing "
                             "to trace (1 of 2 records accepted: length_mismatch 1); leave trace out of --sweeps")


def test_a_metric_without_recovery_ranks_by_its_effect_toward_or_away_from_the_clean_run(warehouse):
    """rank (lower is better, no recovery): a denoising cell is strong as it brings the clean answer's rank
    down, a noising one as it pushes it up."""
    from patchgrid.warehouse.queries import strongest_effects

    cols, rows = strongest_effects(warehouse, "r", top=50, metric="rank")
    cells = [dict(zip(cols, r)) for r in rows if r[cols.index("sweep")] == "resid"]
    for direction, ranked_by, order in (("denoise", "effect toward clean", 1), ("noise", "effect away from clean", -1)):
        mine = [c for c in cells if c["direction"] == direction]
        assert mine and {c["ranked_by"] for c in mine} == {ranked_by}
        effects = [order * c["mean_effect"] for c in mine]
        assert effects == sorted(effects), (direction, effects)
    noise = [c for c in cells if c["direction"] == "noise"]
    assert noise[0]["layer"] == 2 and noise[0]["mean_effect"] > 0  # recovery 0.1: the rank pushed up most
