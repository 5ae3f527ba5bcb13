"""The attention knockout section: knockout_curve's relative change in p and its t interval against a
computation by hand (scipy's quantile) on the stored rows, the section's series and table, the curve
drawn inline and as files, and no section for a run without knockout rows."""
from __future__ import annotations

import re
import statistics
import xml.etree.ElementTree as ET

import pytest
from scipy import stats

from patchgrid.pairs import to_table
from patchgrid.report import collect, write_report
from patchgrid.report.circuit_svg import svg_layer_curve
from patchgrid.report.figures import LayerCurve
from patchgrid.report.files import write_figure
from patchgrid.report.knockout_figures import knockout_section
from patchgrid.rows.effects import effect_row
from patchgrid.rows.shapes import KNOCKOUT_DIRECTION, KNOCKOUT_SITE
from patchgrid.sweeps import Cell
from patchgrid.sweeps.trace import trace_window
from patchgrid.warehouse.loader import connect, load_run, query, start_run
from tests.support.effect_rows import CLEAN, CORRUPT, baseline, make_pair, row, shifted, write_and_read_back

ROLES = ("subject_first", "subject_last", "further", "last")
N_FACTS, N_LAYERS, WINDOW = 6, 6, 3
GROUPS = ("subject", "non_subject", "last")
LAST = len(ROLES) - 1


def change(group: str, layer: int, i: int) -> float:
    """The synthetic model's relative change of p (percent) with `group` blocked around `layer`: the
    subject read at layer 2, the other tokens at layer 1, the last token barely; each fact its wobble
    (none on average over the facts whose clean p is above 0)."""
    deepest = {"subject": (2, -60.0), "non_subject": (1, -20.0), "last": (4, -3.0)}[group]
    return deepest[1] / (1 + abs(layer - deepest[0])) + 4.0 * (i - 2) * (1 + layer % 2)


def clean_p(i: int) -> float:
    """The last fact's clean p is 0: it has an effect but no relative change."""
    return 0.0 if i == N_FACTS - 1 else 0.3 + 0.1 * i


def knockout_rows() -> tuple[list, list]:
    rows, baselines = [], []
    for i in range(N_FACTS):
        pair = make_pair(f"f{i}", ROLES, subject=(0, 2))
        clean = shifted(CLEAN, p=clean_p(i))
        baselines.append(baseline(pair.pair_id, clean, CORRUPT))
        for group in GROUPS:
            for layer in range(N_LAYERS):
                window = len(trace_window(layer, WINDOW, N_LAYERS))  # as KnockoutSweep.rows writes it
                cell = Cell("knockout", KNOCKOUT_SITE, KNOCKOUT_DIRECTION, layer, LAST, window=window,
                            row_columns=(("blocked", group),))
                knocked = shifted(clean, p=clean.p * (1 + change(group, layer, i) / 100) if clean.p else 0.01)
                rows.append(effect_row(pair, cell, knocked, clean, CORRUPT, "p"))
    return rows, baselines


def pair_record(pid: str) -> dict:
    return {"pair_id": pid, "relation": "r", "status": "accepted", "clean_prompt": f"c{pid}",
            "corrupt_prompt": f"x{pid}", "roles": list(ROLES), "subject_start": 0, "subject_end": 2}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A warehouse of two runs: `k` with the knockout rows, `plain` with one resid row and none."""
    tmp = tmp_path_factory.mktemp("knockout")
    wh = tmp / "w.duckdb"
    rows, baselines = knockout_rows()
    f, stored = write_and_read_back(rows, tmp / "k.parquet")
    pairs = to_table([pair_record(f"f{i}") for i in range(N_FACTS)])
    start_run(wh, {"run_id": "k", "model": "m", "params": {"sweeps": ["knockout"], "knockout_window": WINDOW}})
    load_run(wh, "k", pairs, baselines, [f], sweep_kinds={"knockout": "knockout"})
    plain, _ = write_and_read_back([row(make_pair("f0", ROLES, subject=(0, 2)), 0.5, layer=0, position=LAST)],
                                   tmp / "plain.parquet")
    start_run(wh, {"run_id": "plain", "model": "m", "params": {"sweeps": ["resid"]}})
    load_run(wh, "plain", pairs, baselines[:1], [plain], sweep_kinds={"resid": "exact"})
    return wh, stored


@pytest.fixture(scope="module")
def page(study, tmp_path_factory):
    return write_report(study[0], tmp_path_factory.mktemp("knockout-page") / "out", run_id="k")


def _rows(wh, sql, params=None):
    cols, rows = query(wh, sql, params)
    return [dict(zip(cols, r)) for r in rows]


def _section(wh, run_id="k"):
    con = connect(wh)
    try:
        return knockout_section(con, run_id, "knockout")
    finally:
        con.close()


def hand(stored, group, layer):
    """The facts' relative changes of p at (group, layer), their mean and 95% t interval."""
    per = [100 * (r["patched_p"] - r["clean_p"]) / r["clean_p"] for r in stored
           if r["blocked"] == group and r["layer"] == layer and r["clean_p"] > 0]
    mean = statistics.mean(per)
    half = stats.t.ppf(0.975, len(per) - 1) * statistics.stdev(per) / len(per) ** 0.5
    return per, mean, mean - half, mean + half


def test_the_curve_is_the_mean_relative_change_of_p_with_its_t_interval(study):
    wh, stored = study
    curve = _rows(wh, "SELECT * FROM knockout_curve WHERE run_id = 'k' AND metric = 'p'")
    assert len(curve) == len(GROUPS) * N_LAYERS
    for c in curve:
        per, mean, low, high = hand(stored, c["blocked"], c["layer"])
        assert c["headline"] and c["n_pairs"] == N_FACTS and c["n_relative"] == len(per) == N_FACTS - 1
        assert c["mean_relative_change_pct"] == pytest.approx(mean, abs=1e-3)
        assert c["relative_change_ci95_low"] == pytest.approx(low, abs=1e-3)
        assert c["relative_change_ci95_high"] == pytest.approx(high, abs=1e-3)
        assert c["window"] == len(trace_window(c["layer"], WINDOW, N_LAYERS))
    # on every other metric the rows are there, without a relative change, and not the headline
    others = _rows(wh, "SELECT * FROM knockout_curve WHERE run_id = 'k' AND metric <> 'p'")
    assert others and all(r["mean_relative_change_pct"] is None and not r["headline"] for r in others)


def test_the_section_draws_each_group_by_layer_and_its_largest_drop(study):
    wh, stored = study
    section = _section(wh)
    figure = section["curve"]
    assert figure.key == "knockout-relative-change" and figure.metric is None
    assert figure.title == ("Attention knockout: the last position blocked from each group (p, relative change %, "
                            f"{N_FACTS - 1} facts, window {WINDOW} layers)")
    assert figure.y_label == "relative change in p(answer), %"
    assert figure.x_label == "layer (centre of the blocked window)"
    assert [label for label, _ in figure.series] == ["subject", "non-subject", "last token"]
    for group, (_, points) in zip(GROUPS, figure.series):
        assert [p[0] for p in points] == list(range(N_LAYERS))
        for layer, mean, low, high in points:
            _, *want = hand(stored, group, layer)
            assert (mean, low, high) == pytest.approx(tuple(want), abs=1e-3)
    # the table: per group, the layer of the most negative mean relative change
    for group, (label, r) in zip(GROUPS, section["deepest"]):
        means = {layer: hand(stored, group, layer)[1] for layer in range(N_LAYERS)}
        assert r["blocked"] == group and label == dict(zip(GROUPS, ("subject", "non-subject", "last token")))[group]
        assert r["layer"] == min(means, key=means.get) == {"subject": 2, "non_subject": 1, "last": 4}[group]
    assert section["n_facts"] == N_FACTS - 1 and section["window"] == WINDOW


def test_a_run_without_knockout_rows_has_no_knockout_section(study):
    wh, _ = study
    assert _section(wh, "plain") is None
    con = connect(wh)
    try:
        assert collect(con, "plain")["sections"].get("knockout") is None
    finally:
        con.close()


def test_the_layer_curve_draws_a_band_per_stretch_of_intervals_and_a_dashed_zero(tmp_path):
    c = LayerCurve("c", "t", [("a", [(0, 1.0, 0.5, 1.5), (1, 2.0, None, None), (2, -1.0, -2.0, 0.0)]),
                              ("b", [(0, -0.5, -1.0, 0.0), (1, None, None, None), (2, 0.5, 0.0, 1.0)])],
                   "layer", "value")
    svg = svg_layer_curve(c)
    assert ET.fromstring(svg).tag == "{http://www.w3.org/2000/svg}svg"
    assert svg.count("<polygon") == 4 and svg.count("<polyline") == 3 and svg.count("<circle") == 5
    assert 'stroke-dasharray="4 3"' in svg and "95% t interval" in svg
    (png,) = write_figure(c, tmp_path, ("png",))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_page_has_the_section_its_figure_and_its_files(study, page):
    wh, stored = study
    text = page.read_text()
    start = text.index("<h2>Attention knockout (Geva et al. 2023)</h2>")
    section = text[start:text.index("<h2>", start + 1)]
    assert "100 (p_knocked − p_clean) / p_clean" in section and "minus infinity" in section
    assert "data-png='knockout-relative-change.png'" in section and section.count("<svg") == 1
    assert section.count("<circle") == len(GROUPS) * N_LAYERS
    for fmt in ("png", "svg", "pdf"):
        assert f"<a href='knockout-relative-change.{fmt}'>{fmt.upper()}</a>" in section
    assert (page.parent / "knockout-relative-change.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ET.parse(page.parent / "knockout-relative-change.svg").getroot().tag == "{http://www.w3.org/2000/svg}svg"
    # the table's row for the subject: its deepest layer, mean and interval as the hand computation gives them
    _, mean, low, high = hand(stored, "subject", 2)
    cells = re.search(r"<tr><td>subject</td>(.*?)</tr>", section).group(1)
    assert cells == f"<td>2</td><td>{mean:+.1f}</td><td>{low:+.1f} to {high:+.1f}</td><td>{N_FACTS - 1}</td>"


def test_the_study_summary_names_each_groups_deepest_layer(study):
    """summary.knockout_lows (what the study prints): per group, the layer of the most negative mean
    relative change over the facts, as knockout_curve has it; none for a run without knockouts."""
    from patchgrid.cli.study import knockout_lines
    from patchgrid.pipeline.summary import knockout_lows

    wh, _ = study
    lows = knockout_lows(wh, "k")
    curve = query(wh, "SELECT blocked, layer, mean_relative_change_pct FROM knockout_curve "
                      "WHERE run_id = 'k' AND metric = 'p'", arrow=True).to_pylist()
    for low in lows:
        mine = [r for r in curve if r["blocked"] == low["blocked"]]
        assert low["mean_relative_change_pct"] == min(r["mean_relative_change_pct"] for r in mine)
    assert [(r["blocked"], r["layer"]) for r in lows] == [("subject", 2), ("non_subject", 1), ("last", 4)]
    assert lows[0]["window"] == WINDOW and lows[0]["n_pairs"] == N_FACTS - 1
    assert "attention knockout" in "\n".join(knockout_lines(lows))
    assert knockout_lows(wh, "plain") == [] and knockout_lines([]) == []


def test_knockout_rows_say_what_they_are(study):
    """Their direction and site name a knockout (no noising patch of a pattern), they are filed as the
    kind's own shape and are in no effect view; the kind's cells are so."""
    from patchgrid.sweeps import SweepConfig, SweepContext
    from patchgrid.sweeps.knockout import KnockoutSweep

    wh, _ = study
    assert _rows(wh, "SELECT DISTINCT direction, site, row_shape FROM effects WHERE run_id = 'k'") == [
        {"direction": KNOCKOUT_DIRECTION, "site": KNOCKOUT_SITE, "row_shape": "knockout"}]
    assert _rows(wh, "SELECT count(*) AS n FROM effect_summary WHERE run_id = 'k'") == [{"n": 0}]
    ctx = SweepContext(SweepConfig(sweeps=("knockout",), knockout_window=WINDOW), N_LAYERS, 4)
    cells = KnockoutSweep().cells(make_pair("f0", ROLES, subject=(0, 2)), ctx)
    assert {(c.direction, c.site, c.row_column("blocked")) for c in cells} == {
        (KNOCKOUT_DIRECTION, KNOCKOUT_SITE, group) for group in GROUPS}
