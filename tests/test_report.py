"""The report: a self-contained page that headless Chromium renders with every figure drawn."""
from __future__ import annotations

import shutil

import pytest

from patchgrid.cache import load_or_build
from patchgrid.effects import write_effects
from patchgrid.pairs import build_pairs, read_source, to_table
from patchgrid.pairs.pair import accepted_pairs
from patchgrid.report import write_report
from patchgrid.sweeps import SweepConfig, cache_spec, run_sweeps
from patchgrid.warehouse.loader import load_run, start_run
from tests.study_helpers import DATA, noise_std_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory, engines, tokenizers):
    """A real (small) study on tiny-gpt2 with every sweep kind, loaded into a real warehouse."""
    tmp = tmp_path_factory.mktemp("report")
    engine = engines.get("tiny-gpt2", "hf", dtype="float32")
    _, recs = read_source(str(DATA))
    rows = build_pairs(recs, tokenizers("tiny-gpt2"), max_len=1024)
    table = to_table(rows)
    pairs = accepted_pairs(table, 6)
    cfg = SweepConfig(sweeps=("resid", "attn_out", "mlp_out", "heads", "trace"), trace_samples=2)
    cache, _ = load_or_build(engine, pairs, cache_spec(cfg, 4, noise_std_for(engine, pairs)), tmp / "cache", log=lambda *_: None)
    effects = write_effects(run_sweeps(engine, pairs, cache, cfg), tmp / "effects.parquet")
    wh = tmp / "w.duckdb"
    start_run(wh, {"run_id": "run-report", "model": "tiny-gpt2", "params": {"sweeps": list(cfg.sweeps)}})
    load_run(wh, "run-report", table, list(cache.baselines.values()), [effects])
    return wh


def test_report_files(warehouse, tmp_path):
    page = write_report(warehouse, tmp_path / "out")
    text = page.read_text()
    assert "run-report" in text and "tiny-gpt2" in text
    for forbidden in ("http://", "https://", "<script src", "<link"):
        assert forbidden not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert text.count("<figure") == len(pngs)
    for key in ("resid-denoise.png", "resid-noise.png", "attn_out-denoise.png", "mlp_out-denoise.png",
                "heads-all.png", "heads-last.png", "trace-resid.png", "trace-mlp_out.png", "trace-attn_out.png"):
        assert key in pngs
    assert any(p.startswith("relation-") for p in pngs)
    assert "95% t interval" in text and "pairs" in text and "(logit_diff)" in text  # hover text
    assert "no_partner" in text or "answer_multi_token" in text  # rejections by reason


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
        figures = page.query_selector_all("figure")
        assert len(figures) >= 10
        for k, fig in enumerate(figures):
            shot = tmp_path / f"shot-{k}.png"
            fig.screenshot(path=str(shot))
            img = Image.open(shot).convert("RGB")
            assert img.width > 50 and img.height > 50
            colours = img.getcolors(maxcolors=1 << 20)
            assert colours is not None and len(colours) > 8, f"figure {k} looks blank"
            assert max(ImageStat.Stat(img).stddev) > 10, f"figure {k} looks blank"
        browser.close()
    assert errors == []
    assert [u for u in requests if not u.startswith(("file://", "data:"))] == []


def test_noising_draws_the_sites_that_carry_the_answer_as_important(warehouse):
    """Patching the corrupt run's last-layer state at the last position into the clean run makes it
    the corrupt run (recovery 0): the noising picture must draw that cell as important (full red),
    not pale as a recovery scale would."""
    from patchgrid.report import collect, colour, svg_heatmap
    from patchgrid.warehouse.loader import connect

    con = connect(warehouse)
    try:
        figures = {f.key: f for f in collect(con, "run-report")["figures"]}
    finally:
        con.close()
    noise = figures["resid-noise"]
    last = max(r for r in noise.rows if r != "embedding")
    assert noise.values[noise.rows.index(last)][noise.cols.index("last")] == pytest.approx(1.0, abs=1e-3)
    svg = svg_heatmap(noise)
    cell = svg[svg.index(f"layer {last}, position role last:") - 120:svg.index(f"layer {last}, position role last:")]
    assert f'fill="{colour(1.0, 1.0)}"' in cell and colour(1.0, 1.0) == "#b2182b"
    assert "1 − mean recovery" in svg


def test_head_panels_scale_to_their_own_largest_effect(warehouse):
    from patchgrid.report import collect
    from patchgrid.warehouse.loader import connect

    con = connect(warehouse)
    try:
        heads = [f for f in collect(con, "run-report")["figures"] if f.key.startswith("heads-")]
    finally:
        con.close()
    for fig in heads:
        largest = max(abs(v) for row in fig.values for v in row if v is not None)
        assert fig.limit == pytest.approx(largest)
