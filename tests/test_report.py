"""The report: a self-contained page that headless Chromium renders with every figure drawn."""
from __future__ import annotations

import html
import shutil

import pytest

from patchgrid.metrics import METRICS
from patchgrid.pairs import to_table
from patchgrid.report import write_report
from patchgrid.warehouse.loader import load_run, start_run
from tests.effect_rows import CLEAN, CORRUPT, baseline, between, make_pair, row, shifted, write_and_read_back

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
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


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    """A synthetic study with every sweep kind (rows made by patchgrid.effects.effect_row), loaded
    into a real warehouse through the loader."""
    tmp = tmp_path_factory.mktemp("report")
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
                r = importance(layer, role) + jitter
                for sweep in ("resid", "attn_out", "mlp_out"):
                    rows.append(row(pair, r, sweep=sweep, site=sweep, layer=layer, position=pos, clean=clean,
                                    corrupt=corrupt))
                # noising: patching an important site makes the clean run corrupt (recovery 0 at the last
                # layer's last position, exactly)
                rows.append(row(pair, 1 - importance(layer, role), direction="noise", layer=layer, position=pos,
                                clean=clean, corrupt=corrupt))
                for site in ("resid", "mlp_out", "attn_out"):
                    noised = shifted(corrupt, p=0.03)
                    restored = shifted(between(r, clean, noised), p=0.03 + 0.5 * importance(layer, role))
                    rows.append(row(pair, 0, sweep="trace", site=site, layer=layer, position=pos,
                                    window=None if site == "resid" else 3, metric="p", clean=clean, corrupt=noised,
                                    patched=restored))
            for head in range(N_HEADS):
                for position in (None, len(ROLES) - 1):
                    rows.append(row(pair, 0.02 * head * (layer + 1) / N_LAYERS + jitter / 10, sweep="heads",
                                    site="head", layer=layer, position=position, head=head, clean=clean,
                                    corrupt=corrupt))
    pairs.append({"pair_id": "bad", "relation": "capital", "status": "rejected", "reason": "no_partner"})
    effects, _ = write_and_read_back(rows, tmp / "effects.parquet")
    wh = tmp / "w.duckdb"
    start_run(wh, {"run_id": "run-report", "model": "synthetic-model", "params": {"sweeps": ["resid", "heads"]}})
    load_run(wh, "run-report", to_table(pairs), baselines, [effects])
    return wh


def _figures(warehouse):
    from patchgrid.report import collect
    from patchgrid.warehouse.loader import connect

    con = connect(warehouse)
    try:
        return collect(con, "run-report")
    finally:
        con.close()


def test_report_files(warehouse, tmp_path):
    page = write_report(warehouse, tmp_path / "out")
    text = page.read_text()
    assert "run-report" in text and "synthetic-model" in text
    for forbidden in ("http://", "https://", "<script", "<link"):
        assert forbidden not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert text.count("<figure") == len(pngs)
    for metric in METRICS:
        for key in ("resid-denoise", "resid-noise", "attn_out-denoise", "mlp_out-denoise", "heads-all", "heads-last"):
            assert f"{key}-{metric}.png" in pngs
    for key in ("trace-resid.png", "trace-mlp_out.png", "trace-attn_out.png"):
        assert key in pngs
    assert any(p.startswith("relation-") for p in pngs)
    assert "95% t interval" in text and "pairs" in text and "(logit_diff)" in text  # hover text
    assert "no_partner" in text  # rejections by reason
    # one radio button per metric, the headline checked; every metric's meaning is on the page
    assert text.count("type='radio'") == len(METRICS) and "id='metric-0' value='logprob_diff' checked" in text
    for spec in METRICS.values():
        assert html.escape(spec.meaning) in text


def test_every_metric_has_its_figures_named_by_it(warehouse):
    data = _figures(warehouse)
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


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (make test installs Debian's chromium)")
def test_page_renders_in_headless_chromium(warehouse, tmp_path):
    from PIL import Image, ImageStat
    from playwright.sync_api import sync_playwright

    page_path = write_report(warehouse, tmp_path / "out")
    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1366, "height": 800})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(page_path.as_uri())
        page.wait_for_load_state("load")
        n_figures = len(page.query_selector_all("figure"))
        seen = set()
        order = [el.get_attribute("value") for el in page.query_selector_all("input.metric-choice")]
        assert order[0] == "logprob_diff" and set(order) == set(METRICS)  # the headline first
        for k, metric in enumerate(order):
            if k:  # the headline metric is shown without a click
                page.click(f"label[for='metric-{k}']")
            visible = [f for f in page.query_selector_all("figure") if f.is_visible()]
            shown = {f.get_attribute("data-metric") for f in visible} - {None}
            assert shown == {metric}, (metric, shown)
            assert len(visible) >= 10
            for fig in visible:
                key = fig.get_attribute("data-png")
                if key in seen:
                    continue
                seen.add(key)
                shot = tmp_path / f"shot-{len(seen)}.png"
                fig.screenshot(path=str(shot))
                img = Image.open(shot).convert("RGB")
                assert img.width > 50 and img.height > 50
                colours = img.getcolors(maxcolors=1 << 20)
                assert colours is not None and len(colours) > 8, f"figure {key} looks blank"
                assert max(ImageStat.Stat(img).stddev) > 10, f"figure {key} looks blank"
        assert len(seen) == n_figures  # every figure was shown under one metric or another
        browser.close()
    assert errors == []
    assert [u for u in requests if not u.startswith(("file://", "data:"))] == []


def test_noising_draws_the_sites_that_carry_the_answer_as_important(warehouse):
    """Patching the corrupt run's last-layer state at the last position into the clean run makes it
    the corrupt run (recovery 0): the noising picture must draw that cell as important (full red),
    not pale as a recovery scale would."""
    from patchgrid.report import colour, svg_heatmap

    figures = {f.key: f for f in _figures(warehouse)["figures"]}
    noise = figures["resid-noise-logit_diff"]
    last = max(r for r in noise.rows if r != "embedding")
    assert noise.values[noise.rows.index(last)][noise.cols.index("last")] == pytest.approx(1.0, abs=1e-3)
    svg = svg_heatmap(noise)
    cell = svg[svg.index(f"layer {last}, position role last:") - 120:svg.index(f"layer {last}, position role last:")]
    assert f'fill="{colour(1.0, 1.0)}"' in cell and colour(1.0, 1.0) == "#b2182b"
    assert "1 − mean recovery (logit_diff)" in svg


def test_head_panels_scale_to_their_own_largest_effect(warehouse):
    heads = [f for f in _figures(warehouse)["figures"] if f.key.startswith("heads-")]
    assert len(heads) == 2 * len(METRICS)
    for fig in heads:
        largest = max(abs(v) for row in fig.values for v in row if v is not None)
        assert fig.limit == pytest.approx(largest)
