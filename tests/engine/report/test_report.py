"""The report: a self-contained page that headless Chromium renders with every figure drawn, no
label clipped or over another (on the page and in the figures' PNG, SVG and PDF files), each cell's
pair count in its hover text and the cells of few pairs marked."""
from __future__ import annotations

import html
import shutil
import xml.etree.ElementTree as ET

import pytest

from patchgrid.metrics import METRICS
from patchgrid.report import FORMATS, heatmap_figure, scatter_figure, write_report
from patchgrid.report.figures import FEW_PAIRS, Scatter
from tests.unit.report.test_report import N_LAYERS, label_faults

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def pages(tmp_path_factory, warehouse):
    """Each study's report written once for the module, its page: the plain study's with every figure
    in PNG, SVG and PDF (as `patchgrid report` writes them), the others' PNGs alone, to save time."""
    written = {}

    def page_of(study):
        if study not in written:
            formats = FORMATS if study == warehouse else ("png",)
            written[study] = write_report(study, tmp_path_factory.mktemp("pages") / "out", formats=formats)
        return written[study]

    return page_of


def test_report_files(warehouse, pages):
    page = pages(warehouse)
    text = page.read_text()
    assert "run-report" in text and "synthetic-model" in text
    for forbidden in ("http://", "https://", "<script", "<link"):
        assert forbidden not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    pngs = sorted(p.name for p in page.parent.glob("*.png"))
    assert text.count("<figure") == len(pngs)
    # every figure as PNG, SVG and PDF, each linked from its caption
    for png in pngs:
        stem = png.removesuffix(".png")
        svg, pdf = page.parent / f"{stem}.svg", page.parent / f"{stem}.pdf"
        assert ET.parse(svg).getroot().tag == "{http://www.w3.org/2000/svg}svg", stem
        assert pdf.read_bytes()[:5] == b"%PDF-", stem
        assert (page.parent / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
        for fmt in ("PNG", "SVG", "PDF"):
            assert f"<a href='{stem}.{fmt.lower()}'>{fmt}</a>" in text, (stem, fmt)
    # the captions give the pairs per cell; the small multiples' (3 pairs a relation) mark them few
    multiples = text[text.index("<h2>By relation"):]
    assert multiples.count(f"Cells averaged over fewer than {FEW_PAIRS} pairs are faded and marked with a dot") == 2
    assert "Each cell averages 6 pairs" in text[:text.index("<h2>By relation")]
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


# Every <text> of a figure's SVG as Chromium lays it out: its box on the page, its box in its own
# coordinates (before its rotation) and its rotation (angle, centre)
TEXT_BOXES = """fig => { const svg = fig.querySelector('svg'), s = svg.getBoundingClientRect();
  return {svg: [s.left, s.top, s.right, s.bottom], texts: Array.from(svg.querySelectorAll('text')).map(t => {
    const r = t.getBoundingClientRect(), b = t.getBBox();
    const m = /rotate\\(([-\\d.e]+) ([-\\d.e]+) ([-\\d.e]+)\\)/.exec(t.getAttribute('transform') || '');
    return {text: t.textContent, rect: [r.left, r.top, r.right, r.bottom],
            box: [b.x, b.y, b.x + b.width, b.y + b.height], turn: m ? [+m[1], +m[2], +m[3]] : [0, 0, 0]}; })}; }"""


def assert_labels_inside_and_apart(laid, key):
    assert laid["texts"], f"figure {key} has no labels"
    assert label_faults(laid["svg"], laid["texts"]) == [], key


# The figures shown: each one's key, metric, box on the page (from its top left) and labels (TEXT_BOXES)
SHOWN_FIGURES = f"""() => Array.from(document.querySelectorAll('figure')).filter(f => f.checkVisibility()).map(f => {{
  const r = f.getBoundingClientRect(), x = window.scrollX, y = window.scrollY;
  return {{key: f.getAttribute('data-png'), metric: f.getAttribute('data-metric'),
          box: [r.left + x, r.top + y, r.right + x, r.bottom + y], laid: ({TEXT_BOXES})(f)}}; }})"""


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for the module's pages (each test opens a page of its own)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield browser
        browser.close()


def assert_drawn(img, key) -> None:
    from PIL import ImageStat

    assert img.width > 50 and img.height > 50, key
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 8, f"figure {key} looks blank"
    assert max(ImageStat.Stat(img).stddev) > 10, f"figure {key} looks blank"


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (make test installs Debian's chromium)")
@pytest.mark.parametrize("study", ["warehouse", "atp_warehouse", "paths_warehouse"])
def test_page_renders_in_headless_chromium(study, request, pages, chromium):
    """Under each metric, the figures shown are that metric's (and those of no metric), each with its labels
    inside it and apart, and drawn: its pixels in the whole page's screenshot, one per metric."""
    import io

    from PIL import Image

    warehouse = request.getfixturevalue(study)
    page_path = pages(warehouse)
    errors, requests = [], []
    page = chromium.new_page(viewport={"width": 1366, "height": 800})
    try:
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
            visible = page.evaluate(SHOWN_FIGURES)
            shown = {f["metric"] for f in visible} - {None}
            assert shown == {metric}, (metric, shown)
            assert len(visible) >= 10
            shot = Image.open(io.BytesIO(page.screenshot(full_page=True))).convert("RGB")
            for fig in visible:
                if fig["key"] in seen:
                    continue
                seen.add(fig["key"])
                assert_labels_inside_and_apart(fig["laid"], fig["key"])
                assert_drawn(shot.crop(tuple(round(v) for v in fig["box"])), fig["key"])
        assert len(seen) == n_figures  # every figure was shown under one metric or another
    finally:
        page.close()
    assert errors == []
    assert [u for u in requests if not u.startswith(("file://", "data:"))] == []


def test_a_run_without_atp_rows_has_no_atp_section(warehouse, pages, collected):
    data = collected(warehouse)
    assert data["sections"]["atp"] is None
    text = pages(warehouse).read_text()
    assert "AtP" not in text and "atp" not in text and not list(pages(warehouse).parent.glob("atp-*.png"))


def test_atp_section_on_the_page(atp_warehouse, pages, collected):
    text = pages(atp_warehouse).read_text()
    pngs = sorted(p.name for p in pages(atp_warehouse).parent.glob("*.png"))
    assert text.count("<figure") == len(pngs)
    for key in ("atp-resid-logit_diff", "atp-heads-all-logit_diff", "atp-scatter-neuron-logit_diff"):
        assert f"{key}.png" in pngs
    section = text[text.index("<h2>Attribution patching"):text.index("<h2>By relation")]
    assert "Estimate against exact patching" in section and "Top neurons per layer" in section
    agreement = {(a["site"], a["scope"]): a for a in collected(atp_warehouse)["sections"]["atp"]["agreement"]}
    table = section[section.index("<table class='atp-agreement'>"):]
    for (site, where), a in agreement.items():
        cells = f"<tr><td>{site}</td><td>{where}</td><td>logit_diff</td><td>{a['n_pairs']}</td><td>{a['n_sites']}</td>"
        assert cells in table, site
        assert (f"<td>{a['spearman_random']:.3f} [{a['spearman_random_ci95_low']:.3f}, "
                f"{a['spearman_random_ci95_high']:.3f}]</td><td>{a['pearson_pooled']:.3f}</td>"
                f"<td>0.1 (logit_diff)</td><td>0</td>") in table
    resid = agreement[("resid", "per_position")]
    assert (f"<td>{resid['recall_top_k']:.3f} [{resid['recall_top_k_ci95_low']:.3f}, "
            f"{resid['recall_top_k_ci95_high']:.3f}]</td>") in table
    # no exhaustive neuron sweep: no recall
    assert "<td>neuron</td><td>every_position</td><td>logit_diff</td>" in table and "<td>—</td>" in table
    # the neuron table names its metric on every row, and each estimate's hover text its pairs
    neurons = section[section.index("<table class='atp-neurons'>"):section.index("<h3>Agreement")]
    assert neurons.count("<tr><td>logit_diff</td>") == N_LAYERS and "AtP estimate (logit_diff)" in neurons
    # the exact patching figures are all still there, as many as without the atp rows
    assert text.count("data-metric=") == sum(1 for p in pngs if not p.startswith(("atp-", "trace-", "relation-")))


def test_a_run_without_paths_rows_has_no_path_section(warehouse, pages, collected):
    data = collected(warehouse)
    assert data["sections"]["paths"] is None
    text = pages(warehouse).read_text()
    out = pages(warehouse).parent
    assert "Path patching" not in text and "path_summary" not in text
    assert not list(out.glob("paths-*.png")) and not list(out.glob("qkv-*.png"))


def test_path_section_on_the_page(paths_warehouse, pages):
    text = pages(paths_warehouse).read_text()
    pngs = sorted(p.name for p in pages(paths_warehouse).parent.glob("*.png"))
    assert text.count("<figure") == len(pngs)
    for metric in METRICS:
        for key in (f"paths-all-{metric}", f"paths-last-{metric}", f"qkv-k-all-{metric}",
                    f"resid_pre-denoise-{metric}"):
            assert f"{key}.png" in pngs
    section = text[text.index("<h2>Path patching</h2>"):text.index("<h2>By relation")]
    assert "MLPs recomputed" in section and "senders: heads, attn_out, mlp_out" in section
    assert section.count("<figure") == 2 * len(METRICS)
    assert "head.1.2" in section and "q.3.0" in section and "mean effect (logit_diff)" in section
    assert "sender head.1.2, receiver q.3.0: effect (logit_diff)" in section
    # the matrices are switched by the metric buttons like every exact-patching figure
    assert section.count("data-metric='logit_diff'") == 2
    heads = text[text.index("<h2>Attention heads</h2>"):text.index("<h2>Causal tracing</h2>")]
    assert "attention heads&#x27; key (k) patched" in heads and "paths-" not in heads
    layer = text[text.index("<h2>Layer × position patching</h2>"):text.index("<h2>Attention heads</h2>")]
    assert "resid_pre patching" in layer and "resid_mid patching" in layer and "qkv-" not in layer


def figure_faults(fig) -> list:
    """label_faults of a matplotlib figure as drawn: every text it draws, its box on the canvas and,
    for labels turned by an angle other than a right one, its box before the turn about its anchor."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    hidden = set()  # ticks beyond an axis' range: laid out, never drawn
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            eps = (hi - lo) * 1e-10  # matplotlib's own tolerance for a tick at the range's end
            hidden |= {id(label) for t in axis.get_major_ticks() + axis.get_minor_ticks()
                       if not lo - eps <= t.get_loc() <= hi + eps for label in (t.label1, t.label2)}
    texts = []
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip() or id(t) in hidden:
            continue
        rect = list(t.get_window_extent(renderer).extents)
        angle = t.get_rotation()
        if angle % 90 == 0:
            texts.append({"text": t.get_text(), "rect": rect, "box": rect, "turn": [0, 0, 0]})
            continue
        t.set_rotation(0)
        box = list(t.get_window_extent(renderer).extents)
        t.set_rotation(angle)
        x, y = t.get_transform().transform(t.get_position())
        texts.append({"text": t.get_text(), "rect": rect, "box": box, "turn": [angle, x, y]})
    return label_faults((0, 0, fig.bbox.width, fig.bbox.height), texts)


def test_figure_files_have_no_label_clipped_or_over_another(paths_warehouse, atp_warehouse, collected):
    figures = []
    for warehouse in (paths_warehouse, atp_warehouse):
        data = collected(warehouse)
        figures += [f for f in data["figures"] if f.metric in (None, data["headline"])] + data["multiples"]
        for drawing in ("paths", "atp"):
            if data["sections"][drawing]:
                section = data["sections"][drawing]
                figures += [f for f in section["figures"] if f.metric in (None, data["headline"])]
                figures += section.get("scatters", [])
    keys = {f.key.split("-")[0] for f in figures}
    assert {"resid", "heads", "qkv", "trace", "relation", "paths", "atp"} <= keys
    for f in figures:
        fig = scatter_figure(f) if isinstance(f, Scatter) else heatmap_figure(f)
        assert figure_faults(fig) == [], f.key
    # the check finds a label past the figure's edge
    fig = heatmap_figure(figures[0])
    fig.text(0.97, 0.5, "past the right edge")
    assert ("outside", "past the right edge") in figure_faults(fig)

