"""The report: a self-contained page that headless Chromium renders with every figure drawn, no
label clipped or over another (on the page and in the figures' PNG, SVG and PDF files), each cell's
pair count in its hover text and the cells of few pairs marked."""
from __future__ import annotations

import math
import random
import re

import pytest

from patchgrid.metrics import METRICS
from patchgrid.pairs import to_table
from patchgrid.report import svg_heatmap, write_report
from patchgrid.report.figures import FEW_PAIRS, note, pairs
from patchgrid.sweeps.registry import row_shapes
from patchgrid.warehouse.loader import load_run, query, start_run
from tests.support.effect_rows import (
    CLEAN,
    CORRUPT,
    atp_row,
    baseline,
    between,
    make_pair,
    row,
    shifted,
    write_and_read_back,
)

ROLES = ("before_subject", "subject_first", "subject_last", "after_subject", "further", "last")


N_LAYERS, N_HEADS = 6, 4


def importance(layer: int, role: str) -> float:
    """Where the synthetic model keeps the answer: the last subject token in the lower half of the
    layers, the last token in the upper half (the shape Meng et al. report), a little elsewhere."""
    if role == "subject_last":
        return 0.9 if layer < N_LAYERS // 2 else 0.05
    if role == "last":
        return 0.0 if layer < N_LAYERS // 2 else 1.0
    return 0.05


def head_importance(layer: int, head: int) -> float:
    return 0.02 * head * (layer + 1) / N_LAYERS


# Path patching: senders (heads, attn_out and mlp_out of the lower layers) and receivers (the logits,
# and q, k and v of two heads in each upper layer)
PATH_SENDER_LAYERS, PATH_RECEIVER_LAYERS, PATH_RECEIVER_HEADS = (0, 1, 2), (3, 4), (0, 1)


PATH_SENDERS = [s for layer in PATH_SENDER_LAYERS
                for s in [f"head.{layer}.{h}" for h in range(N_HEADS)] + [f"attn_out.{layer}", f"mlp_out.{layer}"]]


PATH_RECEIVERS = ["logits"] + [f"{x}.{layer}.{h}" for layer in PATH_RECEIVER_LAYERS for h in PATH_RECEIVER_HEADS
                               for x in "qkv"]


QKV_SCALE = {"q": 1.0, "k": 0.5, "v": -0.25}


def path_importance(sender: str, receiver: str) -> float:
    """A head of layer 1 matters most, through the query of head 3.0; mlp_out.2 straight to the logits."""
    if (sender, receiver) == ("head.1.2", "q.3.0"):
        return 0.6
    if (sender, receiver) == ("mlp_out.2", "logits"):
        return -0.3
    return 0.01 * (PATH_SENDERS.index(sender) % 5) - 0.005 * (PATH_RECEIVERS.index(receiver) % 3)


def path_rows(pair, clean, corrupt, jitter):
    """The pair's paths rows, every sender to every receiver, at every position at once and at the last."""
    from patchgrid.model.sites import parse_unit_name

    out = []
    for sender in PATH_SENDERS:
        site, layer, head = parse_unit_name(sender)
        for receiver in PATH_RECEIVERS:
            for position in (None, len(ROLES) - 1):
                out.append(row(pair, path_importance(sender, receiver) + jitter / 10, sweep="paths", site=site,
                               layer=layer, position=position, head=head, receiver=receiver, clean=clean,
                               corrupt=corrupt))
    return out


def position_rows(pair, layer, pos, role, clean, corrupt, jitter, paths):
    """The pair's rows at one (layer, position): resid, attn_out and mlp_out patching, with `paths`
    resid_pre and resid_mid, noising, and causal tracing of each of resid, mlp_out and attn_out."""
    r = importance(layer, role) + jitter
    out = [row(pair, r, sweep=sweep, site=sweep, layer=layer, position=pos, clean=clean, corrupt=corrupt)
           for sweep in ("resid", "attn_out", "mlp_out")]
    if paths:  # the stream entering the layer and between attention and MLP
        for sweep, shift in (("resid_pre", -0.1), ("resid_mid", 0.1)):
            out.append(row(pair, r + shift, sweep=sweep, site=sweep, layer=layer, position=pos,
                           clean=clean, corrupt=corrupt))
    # noising: patching an important site makes the clean run corrupt (recovery 0 at the last
    # layer's last position, exactly)
    out.append(row(pair, 1 - importance(layer, role), direction="noise", layer=layer, position=pos,
                   clean=clean, corrupt=corrupt))
    for site in ("resid", "mlp_out", "attn_out"):
        noised = shifted(corrupt, p=0.03)
        restored = shifted(between(r, clean, noised), p=0.03 + 0.5 * importance(layer, role))
        out.append(row(pair, 0, sweep="trace", site=site, layer=layer, position=pos,
                       window=None if site == "resid" else 3, metric="p", clean=clean, corrupt=noised,
                       patched=restored))
    return out


def head_rows(pair, layer, clean, corrupt, jitter, paths):
    """The pair's heads rows of one layer (every position at once, and the last), with `paths` qkv's."""
    out = []
    for head in range(N_HEADS):
        for position in (None, len(ROLES) - 1):
            out.append(row(pair, head_importance(layer, head) + jitter / 10, sweep="heads",
                           site="head", layer=layer, position=position, head=head, clean=clean,
                           corrupt=corrupt))
            if paths:
                for site, scale in QKV_SCALE.items():
                    out.append(row(pair, scale * head_importance(layer, head) + jitter / 10, sweep="qkv",
                                   site=site, layer=layer, position=position, head=head, clean=clean,
                                   corrupt=corrupt))
    return out


def build(tmp, atp=False, paths=False):
    """A synthetic study with every sweep kind (rows made by patchgrid.rows.effects.effect_row), loaded
    into a real warehouse through the loader; `atp`: with attribution-patching rows beside them;
    `paths`: with resid_pre, resid_mid, qkv and path-patching rows beside them (MLPs recomputed)."""
    pairs, baselines, rows = [], [], []
    for i in range(6):
        pid, relation = f"p{i}", ("capital", "currency")[i % 2]
        pairs.append({"pair_id": pid, "relation": relation, "status": "accepted", "clean_prompt": f"c{i}",
                      "corrupt_prompt": f"x{i}", "roles": list(ROLES), "subject_start": 1, "subject_end": 3})
        # each pair its own baselines, so the pairs' recoveries differ and intervals have a width
        clean, corrupt = shifted(CLEAN, logit_diff=2.0 + i / 4, kl=0.0), shifted(CORRUPT, kl=1.5 + i / 5)
        baselines.append(baseline(pid, clean, corrupt))
        pair = make_pair(pid, ROLES, relation, subject=(1, 3))
        jitter = (i - 2.5) / 50
        for layer in range(N_LAYERS):
            for pos, role in enumerate(ROLES):
                rows += position_rows(pair, layer, pos, role, clean, corrupt, jitter, paths)
            rows += head_rows(pair, layer, clean, corrupt, jitter, paths)
        if atp:
            rows += atp_rows(pair, i, clean, corrupt, jitter)
        if paths:
            rows += path_rows(pair, clean, corrupt, jitter)
    pairs.append({"pair_id": "bad", "relation": "capital", "status": "rejected", "reason": "no_partner"})
    effects, _ = write_and_read_back(rows, tmp / "effects.parquet")
    wh = tmp / "w.duckdb"
    params = {"sweeps": ["resid", "heads"]}
    if paths:
        params = {"sweeps": ["resid", "resid_pre", "resid_mid", "heads", "qkv", "paths"],
                  "path_senders": ["heads", "attn_out", "mlp_out"], "path_receivers": ["logits", "heads"],
                  "path_inputs": ["q", "k", "v"], "path_mlps": "recomputed"}
    start_run(wh, {"run_id": "run-report", "model": "synthetic-model", "params": params})
    load_run(wh, "run-report", to_table(pairs), baselines, [effects], sweep_kinds=row_shapes())
    return wh


ATP_K, ATP_R, N_NEURONS = 4, 6, 12


def atp_rows(pair, i, clean, corrupt, jitter):
    """The pair's atp rows: every resid, attn_out and mlp_out site at each position, every head at
    every position at once and at the last, every neuron at every position at once; estimates near
    the exact effects the other sweeps hold (neurons: none exhaustive, ranked by GradDrop); per site
    kind and scope the top ATP_K by the ranking score and ATP_R others at random verified."""
    rng = random.Random(i)
    sites = {site: [(layer, pos, None, None) for layer in range(N_LAYERS) for pos in range(len(ROLES))]
             for site in ("resid", "attn_out", "mlp_out")}
    sites["head"] = [(layer, pos, head, None) for layer in range(N_LAYERS) for pos in (None, len(ROLES) - 1)
                     for head in range(N_HEADS)]
    sites["neuron"] = [(layer, None, None, n) for layer in range(N_LAYERS) for n in range(N_NEURONS)]
    out = []
    for site, coords in sites.items():
        truth = {}
        for layer, pos, head, neuron in coords:
            if site == "head":
                truth[(layer, pos, head, neuron)] = head_importance(layer, head) + jitter / 10
            elif site == "neuron":
                truth[(layer, pos, head, neuron)] = rng.choice((0.3, -0.2, 0.01, 0.0, 0.02)) * (layer + 1) / N_LAYERS
            else:
                truth[(layer, pos, head, neuron)] = importance(layer, ROLES[pos]) + jitter
        span = clean.logit_diff - corrupt.logit_diff
        estimate = {c: r * span * rng.uniform(0.6, 1.3) + rng.gauss(0, 0.2) for c, r in truth.items()}
        graddrop = {c: abs(e) + rng.uniform(0, 0.3) if site == "neuron" else None for c, e in estimate.items()}
        score = {c: graddrop[c] if site == "neuron" else abs(e) for c, e in estimate.items()}
        top, sample = [], []
        for every in (True, False):  # per scope: the cells at every position at once, then those at one
            group = [c for c in coords if (c[1] is None) == every]
            if group:
                top += sorted(group, key=lambda c: -score[c])[:ATP_K]
                sample += rng.sample([c for c in group if c not in top], ATP_R)
        for c in coords:
            verify = "top" if c in top else "random" if c in sample else None
            layer, pos, head, neuron = c
            out.append(atp_row(pair, estimate[c], site=site, layer=layer, position=pos, head=head, neuron=neuron,
                               verify=verify, r=truth[c] if verify else None, graddrop=graddrop[c], clean=clean,
                               corrupt=corrupt))
    return out


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    return build(tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def atp_warehouse(tmp_path_factory):
    return build(tmp_path_factory.mktemp("report-atp"), atp=True)


@pytest.fixture(scope="module")
def paths_warehouse(tmp_path_factory):
    return build(tmp_path_factory.mktemp("report-paths"), paths=True)


def _figures(warehouse):
    from patchgrid.report import collect
    from patchgrid.warehouse.loader import connect

    con = connect(warehouse)
    try:
        return collect(con, "run-report")
    finally:
        con.close()


@pytest.fixture(scope="module")
def collected():
    """Each study's figures and sections (patchgrid.report.collect) read once for the module's tests
    that only read them; a test that patches what collect reads calls _figures itself."""
    read = {}

    def figures_of(study):
        if study not in read:
            read[study] = _figures(study)
        return read[study]

    return figures_of


def _rows(warehouse, sql):
    cols, rows = query(warehouse, sql)
    return [dict(zip(cols, r)) for r in rows]


def test_every_metric_has_its_figures_named_by_it(warehouse, collected):
    data = collected(warehouse)
    assert data["metrics"][0] == data["headline"] == "logprob_diff" and set(data["metrics"]) == set(METRICS)
    switched = [f for f in data["figures"] if f.metric is not None]
    assert {f.metric for f in switched} == set(METRICS)
    for f in switched:
        assert f.title.endswith(f"on {f.metric}") and f.metric in f.units, f.key
        notes = [n for row in f.notes for n in row if n is not None]
        assert notes and all(f"({f.metric})" in n for n in notes), f.key
    figures = {f.key: f for f in switched}
    # kl says lower is closer to clean, and its recovery reads as 1 - KL / KL(corrupt)
    assert "lower is closer to clean" in figures["resid-denoise-kl"].caption
    assert "1 − KL(patched) / KL(corrupt)" in figures["resid-denoise-kl"].caption
    # every metric with a recovery draws it: the synthetic rows recover the same share on each
    last = figures["resid-denoise-logit_diff"].rows.index(N_LAYERS - 1)
    for metric in ("logit_diff", "logprob_diff", "p", "kl", "logp_corrupt"):
        f = figures[f"resid-denoise-{metric}"]
        assert f.units == f"mean recovery ({metric})" and f.limit == 1.0
        assert f.values[last][f.cols.index("last")] == pytest.approx(1.0, abs=1e-4), metric
    # rank has none: its mean effect, patched - corrupt (the rank falls from 6 to 0 where the
    # answer is restored), on the panel's own scale
    rank = figures["resid-denoise-rank"]
    assert rank.units == "mean effect (rank)" and "no recovery" in rank.caption
    assert rank.values[last][rank.cols.index("last")] == pytest.approx(-6.0, abs=1e-3)
    assert rank.limit == pytest.approx(max(abs(v) for r in rank.values for v in r if v is not None))
    # tracing stays on p; its title says so
    assert all(f.title.endswith("on p") for f in data["figures"] if f.key.startswith("trace-"))


def test_unknown_run(warehouse, tmp_path):
    with pytest.raises(ValueError, match="run 'nope' is not in the warehouse"):
        write_report(warehouse, tmp_path, run_id="nope")


def overlap(a, b, tolerance=0.5) -> bool:
    """Whether boxes (x0, y0, x1, y1) overlap by more than `tolerance` px both ways."""
    return a[0] < b[2] - tolerance and b[0] < a[2] - tolerance and a[1] < b[3] - tolerance and b[1] < a[3] - tolerance


def turned_back(t):
    """An SVG text's box in a frame turned back by its rotation (about the origin): two texts of one
    rotation compare there as plain boxes, which their boxes on the page (axis-aligned) do not."""
    angle, cx, cy = t["turn"]
    r = math.radians(angle)
    bx, by = cx * math.cos(r) + cy * math.sin(r), -cx * math.sin(r) + cy * math.cos(r)
    x0, y0, x1, y1 = t["box"]
    return (x0 - cx + bx, y0 - cy + by, x1 - cx + bx, y1 - cy + by)


def label_faults(svg_box, texts) -> list:
    """Texts outside their figure, and pairs of texts drawn over each other."""
    faults = [("outside", t["text"]) for t in texts
              if not (svg_box[0] - 0.5 <= t["rect"][0] and t["rect"][2] <= svg_box[2] + 0.5
                      and svg_box[1] - 0.5 <= t["rect"][1] and t["rect"][3] <= svg_box[3] + 0.5)]
    for i, a in enumerate(texts):
        for b in texts[i + 1:]:
            same = a["turn"][0] == b["turn"][0]
            if overlap(turned_back(a), turned_back(b)) if same else overlap(a["rect"], b["rect"]):
                faults.append(("overlap", a["text"], b["text"]))
    return faults


def test_label_faults_finds_clipped_and_overlapping_labels():
    """The check the browser test applies: a label past the figure's edge, two labels on one
    another, and two rotated labels whose page boxes overlap but whose glyphs do not."""
    def text(x0, y0, x1, y1, turn=(0, 0, 0)):
        return {"text": f"{x0},{y0}", "rect": [x0, y0, x1, y1], "box": [x0, y0, x1, y1], "turn": list(turn)}

    svg = (0, 0, 100, 100)
    assert label_faults(svg, [text(10, 10, 40, 20), text(50, 10, 90, 20)]) == []
    assert label_faults(svg, [text(80, 10, 120, 20)]) == [("outside", "80,10")]
    assert label_faults(svg, [text(10, 10, 40, 20), text(30, 15, 60, 25)]) == [("overlap", "10,10", "30,15")]
    # two labels turned -40 degrees about their own ends, a column (44 px) apart: their page boxes
    # overlap, the labels do not; 8 px apart they do
    def rotated(x, width=60):
        box = [x - width, 40, x, 52]
        r = math.radians(-40)
        corners = [(x + (px - x) * math.cos(r) - (py - 46) * math.sin(r), 46 + (px - x) * math.sin(r)
                    + (py - 46) * math.cos(r)) for px in box[::2] for py in box[1::2]]
        rect = [min(c[0] for c in corners), min(c[1] for c in corners), max(c[0] for c in corners),
                max(c[1] for c in corners)]
        return {"text": str(x), "rect": rect, "box": box, "turn": [-40, x, 46]}

    assert overlap(rotated(30)["rect"], rotated(74)["rect"]) and label_faults((-100, -100, 200, 200),
                                                                              [rotated(30), rotated(74)]) == []
    assert label_faults((-100, -100, 200, 200), [rotated(30), rotated(38)]) == [("overlap", "30", "38")]


def test_noising_draws_the_sites_that_carry_the_answer_as_important(warehouse, collected):
    """Patching the corrupt run's last-layer state at the last position into the clean run makes it
    the corrupt run (recovery 0): the noising picture must draw that cell as important (full red),
    not pale as a recovery scale would."""
    from patchgrid.report import colour, svg_heatmap

    figures = {f.key: f for f in collected(warehouse)["figures"]}
    noise = figures["resid-noise-logit_diff"]
    last = max(r for r in noise.rows if r != "embedding")
    assert noise.values[noise.rows.index(last)][noise.cols.index("last")] == pytest.approx(1.0, abs=1e-3)
    svg = svg_heatmap(noise)
    cell = svg[svg.index(f"layer {last}, position role last:") - 120:svg.index(f"layer {last}, position role last:")]
    assert f'fill="{colour(1.0, 1.0)}"' in cell and colour(1.0, 1.0) == "#b2182b"
    assert "1 − mean recovery (logit_diff)" in svg


def test_head_panels_scale_to_their_own_largest_effect(warehouse, collected):
    heads = [f for f in collected(warehouse)["figures"] if f.key.startswith("heads-")]
    assert len(heads) == 2 * len(METRICS)
    for fig in heads:
        largest = max(abs(v) for row in fig.values for v in row if v is not None)
        assert fig.limit == pytest.approx(largest)


def test_atp_figures_draw_the_estimates_labelled_by_their_metric(atp_warehouse, collected):
    data = collected(atp_warehouse)
    atp = data["sections"]["atp"]
    assert atp["metrics"] == ["logit_diff"]
    figures = {f.key: f for f in atp["figures"]}
    assert set(figures) == {"atp-resid-logit_diff", "atp-attn_out-logit_diff", "atp-mlp_out-logit_diff",
                            "atp-heads-all-logit_diff", "atp-heads-last-logit_diff"}
    summary = {(r["site"], r["layer"], r["position_role"], r["head"], r["neuron"]): r for r in _rows(
        atp_warehouse, "SELECT * FROM atp_summary WHERE run_id = 'run-report'")}
    for key, f in figures.items():
        assert f.title.startswith("AtP estimates") and f.title.endswith("on logit_diff")
        assert f.units == "AtP estimate (logit_diff)" and f.metric is None  # shown whichever metric is selected
        assert "AtP estimate" in f.caption and "logit_diff" in f.caption
        assert f.limit == pytest.approx(max(abs(v) for r in f.values for v in r if v is not None))
        notes = [n for r in f.notes for n in r if n is not None]
        assert notes and all("AtP estimate (logit_diff)" in n and "pairs" in n for n in notes), key
        for i, a in enumerate(f.rows):
            for j, b in enumerate(f.cols):
                if key.startswith("atp-heads-"):
                    role = key.split("-")[2]
                    cell = summary[("head", a, role, b, None)]
                else:
                    cell = summary[(key.split("-")[1], a, b, None, None)]
                assert f.values[i][j] == cell["mean_estimate"]
    # the exact effect over the verified pairs is in the hover text where there is one
    assert any("exact effect (logit_diff)" in n for r in figures["atp-resid-logit_diff"].notes for n in r)
    # the importance pattern the estimates follow: the last subject token low, the last token high
    resid = figures["atp-resid-logit_diff"]
    assert resid.values[0][resid.cols.index("subject_last")] > 2 and resid.values[-1][resid.cols.index("last")] > 2
    # the exact patching figures are as they were, atp rows left out of them
    assert not any(f.key.startswith("atp") for f in data["figures"])


def test_atp_scatter_plots_and_tables(atp_warehouse, collected):
    atp = collected(atp_warehouse)["sections"]["atp"]
    verified = _rows(atp_warehouse, "SELECT site, verify, estimate, effect FROM effects WHERE sweep = 'atp' "
                                    "AND verify IS NOT NULL")
    agreement = {(a["site"], a["scope"]): a for a in atp["agreement"]}
    assert list(agreement) == [("resid", "per_position"), ("attn_out", "per_position"), ("mlp_out", "per_position"),
                               ("head", "every_position"), ("head", "per_position"), ("neuron", "every_position")]
    assert [s.key for s in atp["scatters"]] == [f"atp-scatter-{site}-logit_diff"
                                                for site in dict.fromkeys(site for site, _ in agreement)]
    for s in atp["scatters"]:
        site = s.key.split("-")[2]
        want = sorted((r["estimate"], r["effect"], r["verify"]) for r in verified if r["site"] == site)
        assert sorted(s.points) == [(pytest.approx(x), pytest.approx(y), v) for x, y, v in want]
        scopes = 2 if site == "head" else 1  # heads: every position at once and the last, each its own K and R
        assert {v for *_, v in s.points} == {"top", "random"} and len(s.points) == 6 * (ATP_K + ATP_R) * scopes
        for (kind, where), a in agreement.items():  # each scope's correlations over its random sites
            if kind == site:
                assert (f"Pearson r = {a['pearson_random']:.3f} [{a['pearson_random_ci95_low']:.3f}, "
                        f"{a['pearson_random_ci95_high']:.3f}], Spearman ρ = {a['spearman_random']:.3f}") in s.caption
                assert f"over {a['n_random_verified']} random sites of 6 pairs ({where})" in s.caption
        assert "y = x" in s.caption
        assert s.x_label == "AtP estimate (logit_diff)" and s.y_label == "exact effect (logit_diff)"
        assert ("GradDrop" in s.caption) == (site == "neuron")
    # the neuron view: per layer, the five largest |mean estimates| of that layer, largest first
    neurons = [r for r in _rows(atp_warehouse, "SELECT * FROM atp_summary WHERE site = 'neuron'")]
    assert [(n["layer"], n["position_role"]) for n in atp["neurons"]] == [(layer, "all") for layer in range(N_LAYERS)]
    for n in atp["neurons"]:
        layer = sorted((r for r in neurons if r["layer"] == n["layer"]), key=lambda r: -abs(r["mean_estimate"]))
        assert [r["neuron"] for r in n["top"]] == [r["neuron"] for r in layer[:5]] and n["metric"] == "logit_diff"


def test_atp_scatter_shows_a_fixed_sample_of_many_points(atp_warehouse, monkeypatch):
    import patchgrid.report.estimates as estimates

    monkeypatch.setattr(estimates, "SCATTER_POINTS", 10)
    first, again = (_figures(atp_warehouse)["sections"]["atp"]["scatters"] for _ in range(2))
    for s, t in zip(first, again):
        scopes = 2 if s.key.split("-")[2] == "head" else 1
        assert len(s.points) == 10 and s.points == t.points
        assert f"10 of the {6 * (ATP_K + ATP_R) * scopes} verified sites are shown" in s.caption


def _flat(values):
    return [float("nan") if v is None else v for r in values for v in r]


def test_resid_pre_resid_mid_and_qkv_draw_like_their_kin(paths_warehouse, warehouse, collected):
    data = collected(paths_warehouse)
    figures = {f.key: f for f in data["figures"]}
    for metric in METRICS:
        for sweep in ("resid_pre", "resid_mid"):
            f, kin = figures[f"{sweep}-denoise-{metric}"], figures[f"attn_out-denoise-{metric}"]
            assert (f.rows, f.cols, f.row_axis, f.col_axis) == (kin.rows, kin.cols, "layer", "position role")
            assert f.title == f"{sweep} patching, denoise (clean into corrupt), on {metric}"
        for role in ("all", "last"):
            heads = figures[f"heads-{role}-{metric}"]
            for site in ("q", "k", "v"):
                f = figures[f"qkv-{site}-{role}-{metric}"]
                assert (f.rows, f.cols) == (heads.rows, heads.cols) and f.metric == metric
                assert f.col_axis == ("head" if site == "q" else "key/value head") and f.title.endswith(f"on {metric}")
    # the q panel recovers what the heads panel does, v minus a quarter of it (QKV_SCALE; the pairs'
    # jitter averages out)
    heads, q, v = (figures[k] for k in ("heads-all-logit_diff", "qkv-q-all-logit_diff", "qkv-v-all-logit_diff"))
    assert _flat(q.values) == pytest.approx(_flat(heads.values), abs=1e-5)
    assert v.values[-1][-1] == pytest.approx(-0.25 * head_importance(N_LAYERS - 1, N_HEADS - 1), abs=1e-4)
    # the heads, resid and position figures are those of the run without the new sweeps: paths rows
    # (sites head, attn_out, mlp_out) leak into none of them
    before = {f.key: f for f in collected(warehouse)["figures"]}
    assert set(before) < set(figures)
    for key, f in before.items():
        assert (figures[key].rows, figures[key].cols) == (f.rows, f.cols), key
        assert _flat(figures[key].values) == pytest.approx(_flat(f.values), abs=1e-9, nan_ok=True), key
    assert set(figures) - set(before) == {f"{k}-{m}" for m in METRICS for k in (
        "resid_pre-denoise", "resid_mid-denoise", *(f"qkv-{s}-{r}" for s in "qkv" for r in ("all", "last")))}
    assert not any(k.startswith("paths") for k in figures)


def test_path_matrices(paths_warehouse, collected):
    data = collected(paths_warehouse)
    paths = data["sections"]["paths"]
    figures = {f.key: f for f in paths["figures"]}
    # per metric (the page's order, the headline first) and position role
    assert list(figures) == [f"paths-{role}-{m}" for m in data["metrics"] for role in ("last", "all")]
    summary = {(r["metric"], r["position_role"], r["sender"], r["receiver"]): r for r in _rows(
        paths_warehouse, "SELECT * FROM path_summary WHERE run_id = 'run-report'")}
    for key, f in figures.items():
        _, role, metric = key.split("-", 2)
        # senders by layer (heads, attn_out, mlp_out); receivers logits first, then layer, head, input
        assert f.rows == PATH_SENDERS and f.cols == PATH_RECEIVERS
        assert (f.row_axis, f.col_axis) == ("sender", "receiver") and f.metric == metric
        assert f.title.endswith(f"on {metric}") and "(6 pairs)" in f.title and f.units == f"mean effect ({metric})"
        assert "MLPs recomputed" in f.caption and "6 pairs per cell" in f.caption and metric in f.caption
        assert "Shown:" not in f.caption  # 18 senders and 13 receivers: every one fits
        for i, sender in enumerate(f.rows):
            for j, receiver in enumerate(f.cols):
                cell = summary[(metric, role, sender, receiver)]
                assert f.values[i][j] == cell["mean_effect"]
                assert f"effect ({metric})" in f.notes[i][j] and "6 pairs" in f.notes[i][j]
        assert f.limit == pytest.approx(max(abs(v) for r in f.values for v in r if v is not None))
    # the path that matters stands out: head 1.2 through the query of head 3.0
    f = figures["paths-all-logit_diff"]
    largest = max(((i, j) for i in range(len(f.rows)) for j in range(len(f.cols))), key=lambda c: f.values[c[0]][c[1]])
    assert (f.rows[largest[0]], f.cols[largest[1]]) == ("head.1.2", "q.3.0")


def test_path_matrices_show_the_largest_senders_and_receivers(paths_warehouse, monkeypatch):
    import patchgrid.report.path_matrices as path_matrices

    monkeypatch.setattr(path_matrices, "PATH_TOP", 3)
    f = next(f for f in _figures(paths_warehouse)["sections"]["paths"]["figures"] if f.key == "paths-all-logit_diff")
    assert len(f.rows) == 3 and len(f.cols) == 3
    assert "the 3 of 18 senders and the 3 of 13 receivers with the largest |mean effect|" in f.caption
    assert "head.1.2" in f.rows and "mlp_out.2" in f.rows and {"q.3.0", "logits"} <= set(f.cols)
    # still in matrix order
    assert f.rows == [s for s in PATH_SENDERS if s in f.rows] and f.cols == [r for r in PATH_RECEIVERS if r in f.cols]


def test_path_caption_says_direct_paths_when_mlps_are_frozen(tmp_path):
    from patchgrid.report.path_matrices import mlps_caption

    assert "direct paths only" in mlps_caption({"path_mlps": "frozen"})
    assert "MLPs recomputed" in mlps_caption({"path_mlps": "recomputed"})
    assert "not recorded" in mlps_caption({})


def test_a_cell_of_one_pair_says_1_pair():
    assert (pairs(1), pairs(2), pairs(1, "prompt")) == ("1 pair", "2 pairs", "1 prompt")
    row = {"metric": "logit_diff", "mean_recovery": 0.5, "ci95_low": None, "ci95_high": None, "n_recovery": 1}
    assert note(row).endswith(", 1 pair")


def test_cells_of_few_pairs_are_faded_and_dotted_and_their_counts_said(warehouse, collected):
    data = collected(warehouse)
    figure = next(f for f in data["figures"] if f.key == "resid-denoise-logprob_diff")
    # six pairs behind every cell: none marked, the caption gives the count
    assert {n for r in figure.counts for n in r} == {6} and not figure.few(0, 0)
    assert figure.counts_caption() == " Each cell averages 6 pairs (hover a cell for its count)."
    svg = svg_heatmap(figure)
    assert 'class="few"' not in svg and "fill-opacity" not in svg
    # three pairs per relation: every cell of the small multiples is faded and dotted, and says so
    assert [m.title for m in data["multiples"]] == [f"{r} (3 pairs, logprob_diff)" for r in ("capital", "currency")]
    for m in data["multiples"]:
        n_cells = sum(v is not None for r in m.values for v in r)
        svg = svg_heatmap(m)
        assert n_cells and svg.count('class="few"') == n_cells and svg.count('fill-opacity="0.45"') == n_cells
        assert f"fewer than {FEW_PAIRS} pairs are faded and marked with a dot" in m.counts_caption()
        assert all(n.endswith(", 3 pairs") for r in m.notes for n in r if n)


def test_small_multiples_have_their_own_colour_bar_and_every_layer(warehouse, collected):
    for m in collected(warehouse)["multiples"]:
        svg = svg_heatmap(m)
        assert re.findall(r'class="tick-y"[^>]*>([^<]*)<', svg) == [str(layer) for layer in range(N_LAYERS)]
        assert re.findall(r'class="bar-tick"[^>]*>([^<]*)<', svg) == ["+1", "0", "-1"]
        assert " ".join(re.findall(r'class="bar-label"[^>]*>([^<]*)<', svg)) == "mean recovery (logprob_diff)"

